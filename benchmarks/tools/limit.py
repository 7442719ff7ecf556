"""Run a command under a time limit that says where it hung: the GPU record's replacement for ``timeout``.

    python3 benchmarks/tools/limit.py SECONDS COMMAND [ARG ...]

The command runs in a process group of its own with Python's fault handler on (``PYTHONFAULTHANDLER=1``). Past
SECONDS the whole group gets SIGABRT, so every Python process in it (``torchrun`` and each of its ranks) prints
where each of its threads stands, then SIGKILL 20 s later; the exit status is then 124, as ``timeout``'s, and stderr
says so in a line starting ``limit.py:``. ``timeout`` signals only its child: a hung ``torchrun`` died silently there
and left its ranks holding the GPUs (a megatron-core EP run with TE on 2 x H200 at ``1ca97bc`` stopped so, with no
clue where). Otherwise the exit status is the command's, and a command killed by a signal kills this wrapper by the
same signal (its parent sees what the command's own parent would); SIGTERM and SIGINT sent to this wrapper go to
the whole group. The GPU tests run their entry points through it too (``tests/gpu_utils.run_entry``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import List, Optional

GRACE_S = 20.0


def run(limit: float, cmd: List[str]) -> int:
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONFAULTHANDLER="1"), start_new_session=True)

    def forward(signum: int, _frame: object) -> None:
        os.killpg(proc.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        print(f"limit.py: {' '.join(cmd[:6])} ... still running after {limit:.0f} s: SIGABRT to its process group "
              f"(the tracebacks below), SIGKILL {GRACE_S:.0f} s later", file=sys.stderr, flush=True)
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group (ranks that ignored SIGABRT)
        except ProcessLookupError:
            pass
        proc.wait()
        return 124


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        limit = float(argv[0])
    except ValueError:
        print(f"limit.py: SECONDS must be a number, got {argv[0]!r}; usage: limit.py SECONDS COMMAND [ARG ...]",
              file=sys.stderr)
        return 2
    return run(limit, argv[1:])


def exit_as(status: int) -> None:
    """Leave with the command's status: a negative one (killed by that signal) by the same signal."""
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


if __name__ == "__main__":
    exit_as(main())
