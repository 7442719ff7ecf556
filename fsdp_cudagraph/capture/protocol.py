"""The protocol backend of the whole-step graph kinds (full-iteration, inference): its capture pass and replay check.

On ``backend='protocol'`` ([Note: backends] in config.py) there is no graph. "Capture" runs the step once
inside :func:`capture_pass` (our capture flag, then the engine's simulated capture and its guard, entered in
that order), and every "replay" runs it again from the capture's starting state. A CUDA graph would replay
the capture's host decisions, so a replay that decides otherwise (other collectives, phases, gradient
units, output structure) means the eager schedule and the graphed one compute different things:
:func:`check_replay` raises then. The replay's fresh outputs are written into the captured ones
(:func:`copy_outputs`), as a graph replay writes its static outputs. :class:`ProtocolGraph` puts the three
together behind a graph's ``replay()``.

Knows no engine: the engine's pieces come in as context managers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from fsdp_cudagraph.capture import state as _capture_state

__all__ = ["ProtocolGraph", "capture_pass", "check_replay", "copy_outputs"]


@contextlib.contextmanager
def capture_pass(*regions: Optional[ContextManager[Any]]) -> Iterator[None]:
    """The protocol backend's capture pass: :func:`state.simulated_capture`, then each of ``regions`` (None:
    skipped), entered in order."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_capture_state.simulated_capture())
        for region in regions:
            if region is not None:
                stack.enter_context(region)
        yield


def check_replay(what: str, *, rank: int, collectives: Sequence[str], captured: Sequence[str],
                 decisions: Optional[Mapping[str, Any]] = None, captured_decisions: Optional[Mapping[str, Any]] = None
                 ) -> None:
    """Raise RuntimeError when a protocol replay of ``what`` decided otherwise than its capture.

    ``collectives``: what the replay issued; ``captured``: what the capture issued; ``decisions`` and
    ``captured_decisions``: the replay's and the capture's other host decisions by name (e.g. ``{"phases": trace}``).
    """
    now, then = dict(decisions or {}), dict(captured_decisions or {})
    differ = [name for name in sorted(set(now) | set(then)) if now.get(name) != then.get(name)]
    if list(collectives) == list(captured) and not differ:
        return
    first = next((i for i, (a, b) in enumerate(zip(collectives, captured)) if a != b),
                 min(len(collectives), len(captured)))
    details = [f"collective {first}: {list(collectives[first:first + 1])} vs {list(captured[first:first + 1])}",
               f"{len(collectives)} vs {len(captured)} collectives"]
    details += [f"{name}: {now.get(name)!r:.160} vs {then.get(name)!r:.160}" for name in differ]
    raise RuntimeError(
        f"[rank {rank}] fsdp_cudagraph: protocol replay of {what} issued other collectives or outputs than its "
        f"capture, or took other host decisions ({'; '.join(details)}); a CUDA graph would replay the capture's "
        "decisions and compute something else than an eager run")


def copy_outputs(static: Any, fresh: Any) -> None:
    """Write a replay's ``fresh`` outputs into the captured ``static`` ones (a tensor, or a sequence of tensors)."""
    with torch.no_grad():
        if isinstance(static, torch.Tensor):
            static.copy_(fresh)
            return
        for s, f in zip(static, fresh):
            s.copy_(f)


class ProtocolGraph:
    """The protocol backend's stand-in for a captured ``torch.cuda.CUDAGraph`` (``replay()``, ``reset()``).

    ``run(log) -> (outputs, decisions)`` runs the step once in the capture pass, appending the collectives it
    issues to ``log``; ``start()`` (or None) puts the host state back at the capture's start. ``collectives``,
    ``decisions`` and ``outputs`` are what the capture's own run issued, decided and returned. Each
    :meth:`replay` runs ``start`` and ``run`` again, requires the same collectives and decisions
    (:func:`check_replay`) and writes the fresh outputs into ``outputs`` (:func:`copy_outputs`).
    """

    def __init__(self, what: str, *, rank: int, run: Callable[[List[str]], Tuple[Any, Mapping[str, Any]]],
                 start: Optional[Callable[[], None]], collectives: Sequence[str], decisions: Mapping[str, Any],
                 outputs: Any) -> None:
        self.what, self.rank, self.run, self.start = what, rank, run, start
        self.collectives, self.decisions, self.outputs = list(collectives), dict(decisions), outputs

    def replay(self) -> None:
        if self.start is not None:
            self.start()
        log: List[str] = []
        outputs, decisions = self.run(log)
        check_replay(self.what, rank=self.rank, collectives=log, captured=self.collectives, decisions=decisions,
                     captured_decisions=self.decisions)
        copy_outputs(self.outputs, outputs)

    def reset(self) -> None:
        """Drop what the replays need (the step and its outputs); nothing to free on the protocol backend."""
        self.run, self.start, self.outputs = None, None, None  # type: ignore[assignment]
