#!/usr/bin/env bash
# Sourced by test.sh and demo.sh: sets PY to a Python that has torch and this package.
# - python3 already has torch (a GPU machine): use it, install this package editable without deps
#   (falls back to PYTHONPATH where pip cannot build offline).
# - otherwise (a fresh CPU machine): make .venv, install torch==2.13.0 (the CPU build on this
#   workplace's disk; an unpinned torch would pull a multi-GB CUDA build), then this package with [dev,hf],
#   every package at the version in scripts/constraints.txt (the set last tested), so that a new upstream
#   release cannot change what CI runs. FSDP_CUDAGRAPH_NEWEST=1 drops the constraints (newest releases
#   within pyproject.toml's bounds, in .venv-newest) to try what pip would install today.
# Installing takes most of a rerun's time (13 of 17 s of a demo rerun), so it runs only when what it reads changed:
# a stamp in the environment's folder holds the hash of pyproject.toml, scripts/constraints.txt and this file
# (and, with python3's own torch, of that interpreter's path), written after a successful install.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
_setup_hash() { cat pyproject.toml scripts/constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1; }
# Whether $PY finds these modules (found, not imported: importing torch costs seconds).
_has() { $PY -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in sys.argv[1:]))" "$@"; }
if python3 -c "import torch" 2>/dev/null; then
  PY=python3
  STAMP=build/.setup-stamp   # build/ is ignored by git
  WANT="$(_setup_hash) $(command -v python3)"
  if [ "$(cat $STAMP 2>/dev/null)" != "$WANT" ] || ! _has fsdp_cudagraph; then
    if $PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; then
      mkdir -p build && echo "$WANT" > $STAMP
    else
      export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
  fi
  $PY -c "import pytest" 2>/dev/null || $PY -m pip install -q pytest || echo "pytest is missing and could not be installed"
else
  CONSTRAINTS=(-c scripts/constraints.txt)
  VENV=.venv
  if [ "${FSDP_CUDAGRAPH_NEWEST:-0}" = 1 ]; then
    CONSTRAINTS=()
    VENV=.venv-newest   # its own environment, so that the tested one stays as it is
    echo "FSDP_CUDAGRAPH_NEWEST=1: installing the newest releases into $VENV, not scripts/constraints.txt"
  fi
  [ -x $VENV/bin/python ] || python3 -m venv $VENV
  PY=$VENV/bin/python
  STAMP=$VENV/.fsdp-cudagraph-setup-stamp
  WANT="$(_setup_hash)"
  if [ "$(cat $STAMP 2>/dev/null)" != "$WANT" ] || ! _has fsdp_cudagraph pytest torch; then
    rm -f $STAMP
    $PY -c "import torch" 2>/dev/null || $PY -m pip install -q "${CONSTRAINTS[@]}" "torch==2.13.0"
    $PY -m pip install -q "${CONSTRAINTS[@]}" -e ".[dev,hf]"   # hf: transformers for tests/apps/test_hf.py (about 12 s)
    # NVIDIA Megatron-FSDP (megatron-core's bundled copy) for tests/adapters/test_nvidia.py: its hook registration
    # runs without CUDA. Optional: where no wheel fits this Python, those tests skip with the reason.
    $PY -c "import megatron.core" 2>/dev/null || $PY -m pip install -q "${CONSTRAINTS[@]}" "megatron-core>=0.16.1" \
      || echo "megatron-core could not be installed: the NVIDIA Megatron-FSDP tests will skip"
    echo "$WANT" > $STAMP   # reached only when the installs succeeded (test.sh and demo.sh run with set -e)
  fi
fi
export PY
