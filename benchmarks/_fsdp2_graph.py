"""The torchtitan-style peer: forward+backward of a PyTorch FSDP2 model captured in one ``torch.cuda.graph``.

What torchtitan does (``torchtitan/distributed/cudagraph.py``, written here from its description, not its
code): the first steps run eagerly on one side stream that is joined to the loop's stream; the next step is
captured on that stream with ``capture_error_mode="thread_local"`` (NCCL's watchdog thread keeps querying
events during the capture); every later step copies its batch into the static inputs and replays on the
loop's stream. Gradients must exist when the step is captured, so that FSDP2 accumulates into them in place:
the loop zeroes them with ``optimizer.zero_grad(set_to_none=False)``. The optimizer stays eager.

Imports only torch: ``bench_peers.py`` runs it in a process that must not import this repository's packages.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

__all__ = ["Fsdp2GraphStep"]


class Fsdp2GraphStep:
    """``step(x, y) -> detached loss``: eager for ``warmup`` calls, then captured once and replayed.

    ``fwd_bwd(x, y)`` runs forward, ``loss.backward()`` and returns the loss. A failed capture raises; its
    reason stays in ``error``. ``capture_seconds`` and ``graph_memory_bytes`` describe the capture.
    """

    def __init__(self, fwd_bwd: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, warmup: int,
                 device: torch.device) -> None:
        self.fwd_bwd = fwd_bwd
        self.warmup = warmup
        self.device = device
        self.side = torch.cuda.Stream(device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.static_x: Optional[torch.Tensor] = None
        self.static_y: Optional[torch.Tensor] = None
        self.static_loss: Optional[torch.Tensor] = None
        self.calls = 0
        self.error: Optional[str] = None
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        current = torch.cuda.current_stream(self.device)
        if self.calls <= self.warmup:
            self.side.wait_stream(current)
            with torch.cuda.stream(self.side):
                loss = self.fwd_bwd(x, y).detach()
            current.wait_stream(self.side)
            return loss
        if self.graph is None:
            self._capture(x, y)
        self.static_x.copy_(x)
        self.static_y.copy_(y)
        self.graph.replay()
        return self.static_loss.clone()

    def _capture(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.static_x, self.static_y = x.clone(), y.clone()
        torch.cuda.synchronize(self.device)
        mem0 = torch.cuda.memory_allocated(self.device)
        t0 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.side, capture_error_mode="thread_local"):
                self.static_loss = self.fwd_bwd(self.static_x, self.static_y).detach()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}".strip()[:2000]
            raise
        self.graph = graph
        self.capture_seconds = time.perf_counter() - t0
        self.graph_memory_bytes = torch.cuda.memory_allocated(self.device) - mem0
