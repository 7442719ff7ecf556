"""``python -m fsdp_cudagraph.check --help`` reads as plain text: no Sphinx roles or double backquotes."""

from __future__ import annotations

import pytest

from fsdp_cudagraph.checker.check import main, plain_text


def test_plain_text_drops_sphinx_markup():
    doc = "Use :func:`check_alignment` or :class:`~fsdp_cudagraph.check.ModelSpec`, ``--engine``. Run::\n\n    x"
    assert plain_text(doc) == "Use check_alignment or ModelSpec, --engine. Run:\n\n    x"


def test_checker_help_is_plain_text(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m fsdp_cudagraph.check")
    assert "check_alignment trains the model" in out and "--perturb NAME" in out  # the docstring is there
    assert "``" not in out and ":func:" not in out and ":class:" not in out and "::\n" not in out, out
