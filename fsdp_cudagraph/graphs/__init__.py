"""The graph kinds, one module each: ``partial`` (per-layer graphs under an engine's hooks), ``full_iteration``
(a whole training step), ``optimizer`` (the optimizer step, used by full_iteration), ``inference`` (forward-only
graphs per batch/length bucket) and ``length_buckets`` (partial graphs per padded length).

A graph kind imports ``capture/`` (shared mechanics), ``hooks``, ``config`` and the engine contract
(``engines``; the whole-step kinds also ``megatron_fsdp.graph_contract``), never ``apps/``.
"""
