"""Run a command under a time limit that says where it hung: the GPU record's replacement for ``timeout``.

    python3 benchmarks/tools/limit.py SECONDS COMMAND [ARG ...]

The command runs in a process group of its own with Python's fault handler on (``PYTHONFAULTHANDLER=1``). Past
SECONDS the whole group and every descendant of the command get SIGABRT, so every Python process (``torchrun`` and
each of its ranks) prints where each of its threads stands, then SIGKILL 20 s later. The descendants are found by
their parent links (Linux ``/proc``), not by group: ``torchrun`` starts each rank in a session of its own, so a
signal to the group alone reaches the launcher and none of its ranks (a megatron-core EP run with TE on 4 x H200 at
``1d5df27`` stopped so: torchrun's stacks, none of its ranks'); the exit status is then 124, as ``timeout``'s, and stderr
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
from typing import Dict, Iterable, List, Optional

GRACE_S = 20.0


def descendants(pid: int) -> List[int]:
    """Every live descendant of ``pid``, whatever its process group or session (Linux ``/proc``; elsewhere none)."""
    children: Dict[int, List[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_all(group: int, pids: Iterable[int], signum: int) -> None:
    """``signum`` to the process group ``group`` and to each of ``pids`` that is still there."""
    for target in [*pids, None]:
        try:
            os.kill(target, signum) if target is not None else os.killpg(group, signum)
        except ProcessLookupError:
            pass


def run(limit: float, cmd: List[str]) -> int:
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONFAULTHANDLER="1"), start_new_session=True)

    def forward(signum: int, _frame: object) -> None:
        os.killpg(proc.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        # found before any signal: once the launcher dies its ranks are reparented and no longer its descendants
        tree = descendants(proc.pid)
        print(f"limit.py: {' '.join(cmd[:6])} ... still running after {limit:.0f} s: SIGABRT to its process group "
              f"and its {len(tree)} descendant process(es) (the tracebacks below), SIGKILL {GRACE_S:.0f} s later",
              file=sys.stderr, flush=True)
        signal_all(proc.pid, tree, signal.SIGABRT)
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        # what is left (processes that ignored SIGABRT), the ranks in their own sessions included
        signal_all(proc.pid, tree + descendants(proc.pid), signal.SIGKILL)
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
