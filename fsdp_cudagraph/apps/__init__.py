"""Applications of the library, not the library: the reference GPT (``model``), its training loop
(``train``), the demo, the alignment suites (``align``, ``full_iteration_align``), the vision encoder with
length buckets (``vision``), greedy generation (``generate``) and Hugging Face factories (``hf_models``).
Each runs as ``python -m fsdp_cudagraph.apps.<name>``. Nothing outside ``apps/`` imports these modules
(``tests/unit/test_layout.py`` checks it).
"""
