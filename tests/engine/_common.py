"""Helpers shared by the engine's tests (not a test module): the tiny reference GPT and its training step, the
single-process reference's tolerance, optimizers, the strategy lists and state comparisons."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist
from torch import nn

from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock, loss_fn, synthetic_batch
from megatron_fsdp import MegatronFSDP, fully_shard
from megatron_fsdp._state_dict import gather_region

# Three layers, the middle one MoE (moe_every=2): MoE units are several times larger than dense units, so a
# double buffer sized for a dense unit cannot hold them.
MODEL = dict(vocab_size=64, hidden_size=32, num_layers=3, seq_len=16, moe_every=2)
GLOBAL_BATCH = 8  # divisible by 2 and 4 ranks times 2 micro-batches
NUM_STEPS = 10
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
CPU = torch.device("cpu")

# [Note: matching tolerance]
# Everything is fp32 and deterministic; the one difference from the single-process reference is the order of
# summation of the gradient. The reference sums all samples' contributions inside one backward; FSDP sums
# each rank's share in its own backward, then adds the ranks' (pre-scaled) partial gradients in the
# reduce-scatter or all-reduce. That reorders fp32 additions, a few ulp per gradient element (~1e-7
# relative). Plain SGD with momentum is linear in the gradient, so after 10 steps parameters differ by a
# few ulp of their magnitude (measured: 1.2e-7 absolute on parameters of size ~1-3, loss 2.2e-7
# relative). rtol=1e-5, atol=1e-6 leaves a margin of about 10x over that, and is still 1e4 times below
# what a real error produces (a missing 1/world_size gradient scale, a stale shard or a dropped unit moves
# parameters by ~lr * grad = 1e-3..1e-2). Adam is deliberately not used here: it divides by sqrt(v), so an
# element whose gradient nearly cancels turns a 1e-7 reordering difference into an O(lr) update (measured
# 8e-5 after 10 steps), which would force a tolerance too loose to catch bugs. Adam, with its richer
# optimizer state, is used below where results are compared bit for bit against another FSDP run.
RTOL, ATOL = 1e-5, 1e-6


# --- helpers shared by the ranks and the reference ---------------------------------------------------------------


def build_gpt(seed: int = 0, **overrides: Any) -> Tuple[GPT, GPTConfig]:
    torch.manual_seed(seed)
    cfg = GPTConfig(**{**MODEL, **overrides})
    return GPT(cfg), cfg


def shard(model: nn.Module, **kwargs: Any) -> MegatronFSDP:
    kwargs.setdefault("fsdp_unit_modules", [TransformerBlock])
    return fully_shard(model, **kwargs)


def local_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, cfg: GPTConfig, *, rank: int = 0,
               world: int = 1, num_micro: int = 1) -> torch.Tensor:
    """One optimizer step on this rank's rows of global batch ``step``; returns this rank's loss.

    The global batch is split into ``num_micro`` consecutive micro-batches and each micro-batch into
    ``world`` equal slices; every micro-batch loss is scaled by ``1/num_micro`` so that accumulated gradients
    equal those of the whole batch.
    """
    tokens, targets = synthetic_batch(step, GLOBAL_BATCH, cfg, CPU)
    per_micro = GLOBAL_BATCH // num_micro
    per_rank = per_micro // world
    local = torch.zeros(())
    for m in range(num_micro):
        lo = m * per_micro + rank * per_rank
        loss = loss_fn(model(tokens[lo : lo + per_rank]), targets[lo : lo + per_rank]) / num_micro
        loss.backward()
        local += loss.detach()
    optimizer.step()
    optimizer.zero_grad()
    return local


def eager_losses(forward_step: Any, model: nn.Module, micro_batches: Any) -> torch.Tensor:
    """The eager reference of one step's forwards and backwards: ``forward_step(model, x, y)`` and its backward for
    each ``(x, y)``; the micro-batches' losses, stacked. The optimizer step is the caller's."""
    per = []
    for x, y in micro_batches:
        loss = forward_step(model, x, y)
        loss.backward()
        per.append(loss.detach())
    return torch.stack(per)


def global_loss(local: torch.Tensor, world: int) -> float:
    """Mean of the ranks' losses: the loss of the whole global batch (every rank has as many rows)."""
    total = local.clone()
    dist.all_reduce(total)
    return (total / world).item()


def fsdp_step(model: MegatronFSDP, optimizer: torch.optim.Optimizer, step: int, cfg: GPTConfig, rank: int,
              world: int, num_micro: int = 1) -> float:
    return global_loss(local_step(model, optimizer, step, cfg, rank=rank, world=world, num_micro=num_micro), world)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Dict[Tuple[int, str], torch.Tensor]:
    """Every tensor of the optimizer's per-parameter state, copied, keyed by (parameter index, name)."""
    state = optimizer.state_dict()["state"]
    return {(i, k): torch.as_tensor(v).clone() for i, s in state.items() for k, v in s.items()}


def assert_tensors_equal(actual: Dict[Any, torch.Tensor], expected: Dict[Any, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    different = [k for k in expected if not torch.equal(actual[k], expected[k])]
    assert not different, f"tensors differ: {different}"


def full_optimizer_state(model: MegatronFSDP, optimizer: torch.optim.Optimizer) -> Dict[str, Dict[str, torch.Tensor]]:
    """Per parameter name: every optimizer state tensor at the parameter's full shape (an all-gather per unit)."""
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for u in model.all_units():
        if not u.grad_numel:
            continue
        for k, v in optimizer.state[u.main_shard].items():
            if v.dim() == 0:
                for n in u.layout.names:
                    out.setdefault(n, {})[k] = v.clone()
                continue
            full = gather_region(model, u.layout, v.detach())
            for n, view in zip(u.layout.names, u.layout.views(full)):
                out.setdefault(n, {})[k] = view.clone()
    return out


# The five strategies of the optimizer and fused-weight-gradient tests: ZeRO-3 with and without double buffer.
STRATEGY_CASES = {
    "no_shard": dict(sharding_strategy="no_shard"),
    "optim": dict(sharding_strategy="optim"),
    "optim_grads": dict(sharding_strategy="optim_grads"),
    "zero3": dict(sharding_strategy="optim_grads_params"),
    "zero3+double_buffer": dict(sharding_strategy="optim_grads_params", fsdp_double_buffer=True,
                                fsdp_db_use_persist_buf_on_alloc_fail=True),
}


def protocol_layer_graphs(model: nn.Module) -> Any:
    """Per-layer graphs of every unit of ``model`` (a ``megatron_fsdp`` engine with the double buffer) on the CPU
    protocol backend: one warm-up step, two warm-up iterations, ``capture()`` left to the caller."""
    from fsdp_cudagraph import CudaGraphConfig, PartialCudaGraphs

    return PartialCudaGraphs(model, CudaGraphConfig(
        cuda_graph_impl="local", cuda_graph_modules=[], use_megatron_fsdp=True, fsdp_double_buffer=True,
        fsdp_db_use_persist_buf_on_alloc_fail=True, cuda_graph_warmup_steps=1, cuda_graph_num_warmup_iters=2),
        backend="protocol")


def accumulated_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, rank: int,
                     micro: int = 2) -> torch.Tensor:
    """One step of ``micro`` micro-batches of two rows each (this rank's rows of ``x``/``y``, which hold
    ``2 * micro`` rows a rank), clipped to norm 1, then the optimizer step; the step's loss (fp32)."""
    total = torch.zeros(())
    for m in range(micro):
        lo = (rank * micro + m) * 2
        loss = loss_fn(model(x[lo:lo + 2]), y[lo:lo + 2]) / micro
        loss.backward()
        total += loss.detach().float()
    model.clip_grad_norm_(1.0)
    optimizer.step()
    optimizer.zero_grad()
    return total
