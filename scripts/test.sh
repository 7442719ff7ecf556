#!/usr/bin/env bash
# The README's test command: set up, then run the suite. Extra arguments go to pytest (e.g. -m gpu).
# On a CPU machine GPU and TE tests skip with their reason.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
exec $PY -m pytest "$@"
