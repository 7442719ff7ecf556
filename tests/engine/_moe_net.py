"""A tiny mixture-of-experts network for the expert-parallel tests (not a test module).

``MoENet``: an input projection, ``num_layers`` blocks, a head. A block is a dense sublayer (``mix``: linear +
tanh, residual) and an MoE sublayer: a router (``Linear(H, E)`` + softmax), top-1 routing, ``E`` experts each a
two-layer MLP, the expert output weighted by its router probability (so the router trains), residual. At
``ep_size = 1`` the block holds all ``E`` experts and runs them locally; at ``ep_size = k`` it holds only its
``E/k`` local experts, ``experts.{global index}`` (names unique across EP ranks), and moves tokens with
all-to-alls over the EP group:

1. sort the local tokens by expert (stable: a token keeps its place among the tokens of its expert);
2. exchange the per-expert counts (``all_to_all_single`` of the ``E`` counts: rank ``q`` receives, from every
   rank of its EP group, the counts of its own local experts);
3. dispatch: ``all_to_all_single`` of the sorted tokens with the counts' sums as split sizes; what arrives is
   ordered (source rank, local expert), regrouped per local expert (sources in rank order);
4. each local expert runs once on all its tokens; the results go back to (source, expert) order;
5. combine: the reverse all-to-all, then the inverse of the sort.

Dispatch and combine are one autograd function whose backward is the reverse all-to-all. Every index is
computed from the routing, nothing accumulates atomically, so a run is deterministic. ``moe_every`` other
than 1 leaves some blocks dense. ``local_names=True`` numbers the local experts from 0 on every EP rank
(megatron-core's ``local_experts.i``): such a model trains, but its state dicts are refused.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fsdp_cudagraph.apps.moe_ep import AllToAll, exchange_counts, regroup  # the reference MoE's (torch only)

HIDDEN, FFN, NUM_EXPERTS, NUM_LAYERS = 8, 16, 4, 2


class Expert(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn)
        self.w2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.tanh(self.w1(x)))


class MoE(nn.Module):
    def __init__(self, hidden: int, ffn: int, num_experts: int, ep_group: Optional[dist.ProcessGroup],
                 local_names: bool = False, num_local: Optional[int] = None) -> None:
        super().__init__()
        self.ep_group = ep_group
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        self.num_experts = num_experts
        self.num_local = num_local if num_local is not None else num_experts // self.ep_size
        first = ep_rank * (num_experts // self.ep_size)
        self.router = nn.Linear(hidden, num_experts, bias=False)
        names = range(self.num_local) if local_names else range(first, first + self.num_local)
        self.experts = nn.ModuleDict({str(i): Expert(hidden, ffn) for i in names})
        self.experts.is_expert = True  # the engine's tag (the name segment "experts" would do as well)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x), dim=-1)
        choice = probs.argmax(dim=-1)
        weight = probs.gather(1, choice[:, None])
        order = torch.argsort(choice, stable=True)
        counts = torch.bincount(choice, minlength=self.num_experts)
        local = list(self.experts.values())
        sorted_x = x[order]
        if self.ep_size == 1:
            outs = [e(chunk) for e, chunk in zip(local, sorted_x.split(counts.tolist()))]
            sorted_y = torch.cat(outs)
        else:
            # The reference MoE's exchange (fsdp_cudagraph/apps/moe_ep.py): counts, dispatch, combine.
            ep, group = self.ep_size, self.ep_group
            send, recv = exchange_counts(counts, group, ep)  # [rank][local expert] host tables
            send_splits, recv_splits = [sum(r) for r in send], [sum(r) for r in recv]
            by_expert = regroup(AllToAll.apply(sorted_x, recv_splits, send_splits, group), recv)
            sizes = [sum(recv[s][l] for s in range(ep)) for l in range(len(local))]
            out = torch.cat([e(chunk) for e, chunk in zip(local, by_expert.split(sizes))])
            returned = regroup(out, [list(col) for col in zip(*recv)])  # back to (source, local expert)
            sorted_y = AllToAll.apply(returned, send_splits, recv_splits, group)
        y = sorted_y[torch.argsort(order)]
        return y * weight


class Block(nn.Module):
    def __init__(self, hidden: int, ffn: int, num_experts: int, ep_group: Optional[dist.ProcessGroup], moe: bool,
                 **moe_kwargs: Any) -> None:
        super().__init__()
        self.mix = nn.Linear(hidden, hidden)
        self.moe = MoE(hidden, ffn, num_experts, ep_group, **moe_kwargs) if moe else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.mix(x))
        return x + self.moe(x) if self.moe is not None else x


class MoENet(nn.Module):
    def __init__(self, ep_group: Optional[dist.ProcessGroup] = None, *, hidden: int = HIDDEN, ffn: int = FFN,
                 num_experts: int = NUM_EXPERTS, num_layers: int = NUM_LAYERS, moe_every: int = 1,
                 **moe_kwargs: Any) -> None:
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)
        self.layers = nn.ModuleList(Block(hidden, ffn, num_experts, ep_group, moe=(i % moe_every == moe_every - 1),
                                          **moe_kwargs) for i in range(num_layers))
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).squeeze(-1)


def build(ep_group: Optional[dist.ProcessGroup] = None, seed: int = 0, **kwargs: Any) -> MoENet:
    """The model with this rank's experts, initialised as the EP=1 model of ``seed`` (the same values per expert)."""
    torch.manual_seed(seed)
    full = MoENet(None, **{k: v for k, v in kwargs.items() if k not in ("local_names", "num_local")})
    if ep_group is None:
        return full
    model = MoENet(ep_group, **kwargs)
    values = full.state_dict()
    if kwargs.get("local_names") or kwargs.get("num_local") is not None:
        return model  # experts keep their own initial values: not compared with a reference
    missing, _ = model.load_state_dict(values, strict=False)
    assert not missing, missing
    return model


GLOBAL_TOKENS = 32


def batch(step: int) -> Any:
    """Global batch ``step``: ``GLOBAL_TOKENS`` tokens of width ``HIDDEN`` and their regression targets."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_TOKENS, HIDDEN, generator=g)
    y = torch.randn(GLOBAL_TOKENS, generator=g)
    return x, y


def local_rows(step: int, rank: int, world: int) -> Any:
    x, y = batch(step)
    per = GLOBAL_TOKENS // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)


def adam(params: Any) -> torch.optim.Optimizer:
    # [Note: Adam's eps in the EP tests] see test_ep_training.py
    return torch.optim.Adam(params, lr=1e-2, eps=1e-3)


def reference_run(num_steps: int, *, clip: Optional[float] = None, seed: int = 0) -> Dict[str, Any]:
    """The EP=1 model on the whole global batch, one process: per-step loss (and norm), final parameters."""
    model = build(None, seed)
    opt = adam(model.parameters())
    losses, norms = [], []
    for step in range(num_steps):
        x, y = batch(step)
        loss = loss_fn(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def merge_states(per_rank: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """One dict from the ranks' ``state_dict()``s (dense keys from every rank must agree bit for bit)."""
    out: Dict[str, torch.Tensor] = {}
    for sd in per_rank:
        for k, v in sd.items():
            if k in out:
                assert torch.equal(out[k], v), f"{k} differs between ranks"
            else:
                out[k] = v
    return out
