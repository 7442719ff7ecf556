"""This project's engine, ``megatron_fsdp``: its adapter (``adapter.py``) and its builder (``build.py``)."""

import importlib.util
import os

#: The line that marks this project's ``megatron_fsdp/__init__.py``.
MARKER = '__distribution__ = "fsdp-cudagraph"'


def require_this_projects_engine() -> str:
    """The path of the ``megatron_fsdp`` package Python imports, checked to be this project's engine.

    [Note: one import name, two packages] NVIDIA's standalone PyPI package ``megatron-fsdp`` is imported as
    ``megatron_fsdp`` too. Whichever comes first on ``sys.path`` wins (installed into one environment, the second
    overwrites the first's files), and NVIDIA's ``fully_shard`` takes other arguments and builds another engine.
    The source of the package found is read, not imported (NVIDIA's imports dependencies of its own): this
    project's ``__init__.py`` carries :data:`MARKER`. NVIDIA's engine stays usable through megatron-core's bundled
    copy, ``megatron.core.distributed.fsdp.src.megatron_fsdp``, which is what the ``nvidia`` engine uses.
    """
    spec = importlib.util.find_spec("megatron_fsdp")
    origin = getattr(spec, "origin", None)
    try:
        with open(origin) as f:  # type: ignore[arg-type]
            if MARKER in f.read():
                return os.path.dirname(origin)
    except (TypeError, OSError):
        pass
    found = "no package named megatron_fsdp" if spec is None else f"megatron_fsdp at {origin}"
    raise ImportError(
        f"this project's engine is the package megatron_fsdp, but Python finds {found}, which is not it (its "
        f"__init__.py lacks the line {MARKER}): NVIDIA's standalone megatron-fsdp package has the same import name. "
        "Fix: pip uninstall megatron-fsdp (reach NVIDIA's engine through megatron-core, which bundles it, as "
        "engine='nvidia' does), then pip install --force-reinstall --no-deps fsdp-cudagraph (an install into the "
        "same environment overwrote files); or put this project's root first on PYTHONPATH")


require_this_projects_engine()

from fsdp_cudagraph.engines.megatron_fsdp.build import BUILDER  # noqa: E402
from fsdp_cudagraph.engines.megatron_fsdp.adapter import (MegatronFSDPEngine, PLANNED_ROLES, ROLE_ATTR,  # noqa: E402
                                                           plan_hooks)

__all__ = ["BUILDER", "MegatronFSDPEngine", "PLANNED_ROLES", "ROLE_ATTR", "plan_hooks", "require_this_projects_engine"]
