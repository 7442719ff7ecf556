"""Probe TransformerEngine once, at import.

Everything in the package that needs TE asks this module instead of importing TE itself, so that the
absence of TE is discovered in one place and explained with one reason string (which tests reuse in their
skip messages).
"""

from __future__ import annotations

from typing import Any, Optional

from packaging.version import Version

__all__ = ["HAS_TE", "TE_REASON", "TE_VERSION", "MIN_TE_VERSION", "require_te", "te_pytorch"]

#: Oldest TE whose ``make_graphed_callables`` accepts ``capture_time_hooks``.
MIN_TE_VERSION = Version("2.19")

TE_VERSION: Optional[Version] = None
te_pytorch: Any = None
HAS_TE = False
TE_REASON = ""

try:  # pragma: no cover - depends on the machine
    import transformer_engine as _te
    import transformer_engine.pytorch as _te_pytorch

    TE_VERSION = Version(_te.__version__.split("+")[0])
    if TE_VERSION < MIN_TE_VERSION:
        TE_REASON = (
            f"TransformerEngine {TE_VERSION} is installed, but capture_time_hooks needs >= {MIN_TE_VERSION}; "
            "upgrade with: pip install 'fsdp-cudagraph[te]'"
        )
    else:
        te_pytorch = _te_pytorch
        HAS_TE = True
except Exception as exc:  # ImportError, or a TE build that fails to load its library
    TE_REASON = (
        f"TransformerEngine is not importable ({type(exc).__name__}: {exc}); "
        "install it with: pip install 'fsdp-cudagraph[te]'"
    )


def require_te(what: str) -> Any:
    """Return ``transformer_engine.pytorch`` or raise ImportError saying what needed it and how to get it."""
    if not HAS_TE:
        raise ImportError(f"{what} needs TransformerEngine >= {MIN_TE_VERSION}: {TE_REASON}")
    return te_pytorch
