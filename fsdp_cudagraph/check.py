"""The alignment checker's public door: ``python -m fsdp_cudagraph.check``, ``fsdp_cudagraph.check.ModelSpec``.

The checker lives in :mod:`fsdp_cudagraph.checker.check` (the room of what users run to check their own
training); this module keeps the command and the import path that users and factories already spell.
"""

from fsdp_cudagraph.checker.check import AlignmentReport, ModelSpec, check_alignment, main

__all__ = ["ModelSpec", "AlignmentReport", "check_alignment", "main"]

if __name__ == "__main__":
    # Run the importable module's main, not a __main__ copy: factories return fsdp_cudagraph.check.ModelSpec,
    # the class imported above from fsdp_cudagraph.checker.check.
    from fsdp_cudagraph.checker.records import exit_process

    exit_process(main())  # the verdict is printed and the group destroyed: the exit status is the verdict
