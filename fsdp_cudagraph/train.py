"""Deprecated one-release alias of :mod:`fsdp_cudagraph.apps.train` (import or ``python -m`` that instead)."""

from fsdp_cudagraph.apps._moved import moved

moved(__name__, "fsdp_cudagraph.apps.train")
