"""What users run to check their own training: the alignment checker (``check``, behind
``python -m fsdp_cudagraph.check``), its divergence localisation (``divergence``) and the run records and
clean exit (``records``) that the checker, the applications and the benchmarks share.
"""
