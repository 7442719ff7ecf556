"""One-release aliases for the applications that moved into ``fsdp_cudagraph/apps/``.

``fsdp_cudagraph.demo`` (and ``.align``, ``.full_iteration_align``, ``.vision``, ``.generate``, ``.model``,
``.train``, ``.hf_models``) were top-level modules before the package was split into rooms by role. Each old
name is now a three-line module calling :func:`moved`: importing it warns and hands back the new module
object (so attributes, monkeypatching and ``isinstance`` see one module), and ``python -m`` on it warns and
runs the new module as ``__main__``. Remove the aliases one release after the move.
"""

from __future__ import annotations

import importlib
import runpy
import sys
import warnings


def moved(old_name: str, new_name: str) -> None:
    """Alias module ``old_name`` to ``new_name`` (call from the alias module with its ``__name__``)."""
    running = old_name == "__main__"
    shown = new_name.replace(".apps.", ".", 1) if running else old_name
    warnings.warn(f"{shown} moved to {new_name}; the old name is a one-release alias: import {new_name} "
                  f"(or run python -m {new_name}) instead", DeprecationWarning, stacklevel=3)
    if running:
        runpy.run_module(new_name, run_name="__main__", alter_sys=True)
    else:
        sys.modules[old_name] = importlib.import_module(new_name)
