#!/usr/bin/env bash
# Create (or reuse) .venv and install the package with its test extras. On a machine without torch it
# installs torch==2.13.0, the CPU build (the workplace's disk holds it; an unpinned torch would pull a
# multi-GB CUDA build). Where python3 already has torch (a GPU machine), the venv sees that torch instead.
set -euo pipefail
cd "$(dirname "$0")/.."
if python3 -c "import torch" 2>/dev/null; then
  [ -d .venv ] || python3 -m venv --system-site-packages .venv
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null || .venv/bin/python -m pip install -q --no-deps -e .
  .venv/bin/python -c "import pytest" 2>/dev/null || .venv/bin/python -m pip install -q pytest || true
else
  [ -d .venv ] || python3 -m venv .venv
  .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev]"
fi
