"""The suite's shared fixtures and its markers by folder.

Markers (registered in pyproject.toml, run with ``--strict-markers``):
- ``gpu``: every test under ``tests/gpu/`` (added here, by folder) except the full matrices, which carry ``matrix``
  and run with ``-m matrix`` ([Note: the quick and the full matrix] in ``tests/gpu/test_alignment.py``); each still
  skips without a GPU, with the reason.
- ``gloo``: tests that spawn CPU ranks with a Gloo process group; each such file says so itself (``pytestmark``).
- ``quick``: the subset that ``bash scripts/test.sh -m quick`` runs in under two minutes on two cores: the
  unit tests (config, hooks, layout, arguments, buckets), the partial-graph protocol schedule on 2 Gloo ranks
  (one spawned job shared by its tests: each FSDP phase once per pass, replays with hooks around, hooks restored,
  losses equal to eager through capture and delete), one engine test on 2 Gloo ranks, the clipping and
  ``zero_grad`` paths of the engine (2 Gloo ranks) and the inner-module refusals. Listed in ``QUICK``
  below by folder, file or test name.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

_TESTS = os.path.dirname(os.path.abspath(__file__))

# Paths relative to tests/: a folder ("unit/"), a file ("x/test_y.py") or a test ("x/test_y.py::test_z", which
# takes every parametrization of it).
QUICK = (
    "unit/",
    "graphs/test_partial_protocol.py::test_each_fsdp_phase_runs_once_per_pass_outside_capture",
    "graphs/test_partial_protocol.py::test_replays_go_through_call_with_hooks_around",
    "graphs/test_partial_protocol.py::test_hooks_restored_after_capture_and_delete",
    "graphs/test_partial_protocol.py::test_losses_equal_eager_through_capture_and_delete",
    "engine/test_root_slot.py::test_the_engine_keeps_no_root_sized_gradient_buffer",
    "engine/test_clip.py",  # the silent paths a newcomer hits first: torch's clipping, model.zero_grad()
    "adapters/test_inner_module.py",  # the inner module passed instead of the engine's wrapper
)


def _is_quick(relpath: str, name: str) -> bool:
    test = f"{relpath}::{name.split('[', 1)[0]}"
    return any(test == q or (q.endswith("/") and relpath.startswith(q)) or relpath == q for q in QUICK)


def _quick_files() -> tuple:
    return tuple(q.split("::", 1)[0] for q in QUICK)


def pytest_ignore_collect(collection_path, config: pytest.Config):
    """Under ``-m quick`` alone, files with no quick test are not even imported: collecting the whole suite
    (megatron-core, transformers) costs more than running the quick tests."""
    if (config.getoption("markexpr", "") or "").strip() != "quick" or not collection_path.name.startswith("test_"):
        return None
    relpath = os.path.relpath(str(collection_path), _TESTS).replace(os.sep, "/")
    if relpath.startswith(".."):
        return None
    return not any(relpath == q or (q.endswith("/") and relpath.startswith(q)) for q in _quick_files())


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        relpath = os.path.relpath(str(item.path), _TESTS).replace(os.sep, "/")
        if relpath.startswith("gpu/") and item.get_closest_marker("matrix") is None:
            item.add_marker(pytest.mark.gpu)  # a full matrix stays opt-in ([Note: the quick and the full matrix])
        if _is_quick(relpath, item.name):
            item.add_marker(pytest.mark.quick)


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank Gloo process group in this process (file rendezvous under ``tmp_path``), destroyed afterwards."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
