"""Modules' extra state (``get_extra_state``/``set_extra_state``) through the engine's checkpoints, on CPU.

TransformerEngine keeps FP8 scaling state (delayed scaling's amax history and scales) as module extra state:
``get_extra_state()`` returns a uint8 CPU tensor of pickled bytes, ``set_extra_state()`` copies it back into the
module's device tensors, in place. There is no TE here, so a stand-in keeps extra state the TE way: a linear
layer whose forward records its input's amax in a history and derives a scale from it (the state changes every
step and feeds the next step's output, as delayed scaling's does); its ``get_extra_state`` returns either a
uint8 tensor of pickled bytes (TE's form) or a plain ``bytes`` object, and ``set_extra_state`` copies into the
same tensors. Like TE's delayed scaling with its amax reduction group, the amax is reduced over the ranks, so
the state is the same on every rank (DCP keeps one copy of such a value). Checked on 2 Gloo ranks: ``state_dict``/``load_state_dict`` and DCP (``sharded_state_dict``,
``torch.distributed.checkpoint``, ``load_sharded_state_dict``) into a fresh model whose extra state is still
empty (an empty tensor, as TE's is before its first FP8 forward); the restored state is ``torch.equal`` to
the saved one, and training resumed from it gives every loss and parameter of the uninterrupted run bit for bit.
A model restored without its extra state diverges (the negative control).
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from megatron_fsdp import decode_extra_state, fully_shard
from megatron_fsdp._dcp import encode_extra_state
from tests.dist_utils import run_gloo

pytestmark = pytest.mark.gloo

HIDDEN, HISTORY = 16, 4


class ScaledLinear(nn.Module):
    """A linear layer with delayed-scaling-like state: ``y = linear(x * scale)``, where ``scale`` comes from the
    amax history of earlier steps and the history takes this step's input amax (in place, as TE's do)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)
        self.form = form
        self.amax_history = torch.zeros(HISTORY)  # plain attributes: not buffers, only the extra state carries them
        self.scale = torch.ones(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x * self.scale.clone())  # the value of this step; the state moves on below
        with torch.no_grad():
            self.amax_history.copy_(torch.roll(self.amax_history, 1))
            amax = x.detach().abs().max()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)  # TE reduces amaxes over the data-parallel group
            self.amax_history[0] = amax
            self.scale.copy_(1.0 / (1.0 + self.amax_history.max()))
        return y

    def get_extra_state(self) -> Any:
        if not bool(self.amax_history.any()):  # never ran: TE returns an empty tensor before its first FP8 forward
            return torch.empty(0, dtype=torch.uint8) if self.form == "tensor" else b""
        payload = pickle.dumps({"amax_history": self.amax_history.clone(), "scale": self.scale.clone()})
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.form == "tensor" else payload

    def set_extra_state(self, state: Any) -> None:
        raw = state.numpy().tobytes() if isinstance(state, torch.Tensor) else bytes(state)
        if not raw:
            return
        loaded = pickle.loads(raw)
        self.amax_history.copy_(loaded["amax_history"])  # in place: addresses kept (a graph reads them)
        self.scale.copy_(loaded["scale"])


class Block(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.fc = ScaledLinear(form)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(form) for _ in range(2))
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def _build(form: str, seed: int) -> Any:
    torch.manual_seed(seed)
    return fully_shard(Net(form), fsdp_unit_modules=[Block], sharding_strategy="optim_grads_params")


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model: Any, opt: torch.optim.Optimizer, steps: range, rank: int) -> List[torch.Tensor]:
    losses = []
    for step in steps:
        loss = model(_batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _extra(model: Any) -> Dict[str, Any]:
    return {n: (m.amax_history.clone(), m.scale.clone()) for n, m in model.module.named_modules()
            if isinstance(m, ScaledLinear)}


def _same_extra(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(x, y) for k in a for x, y in zip(a[k], b[k]))


def _job(rank: int, world: int, directory: str, form: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    # the uninterrupted run: 3 steps, checkpoint, 3 more
    model = _build(form, 0)
    opt = torch.optim.SGD(model.optimizer_parameters(), lr=0.1)
    _train(model, opt, range(3), rank)
    saved_extra = _extra(model)
    sd = model.state_dict()
    out["keys"] = sorted(k for k in sd if k.endswith("_extra_state"))
    out["value_type"] = type(sd["layers.0.fc._extra_state"]).__name__
    dcp.save({"model": model.sharded_state_dict()}, checkpoint_id=directory)
    want = _train(model, opt, range(3, 6), rank)
    want_state = model.state_dict()

    def resumed(load: str) -> Dict[str, Any]:
        fresh = _build(form, 1)  # other initial values, empty extra state
        empty = fresh.state_dict()["layers.0.fc._extra_state"]
        res: Dict[str, Any] = {"fresh_empty": len(empty) == 0}
        if load == "state_dict":
            fresh.load_state_dict(sd)
        elif load == "dcp":
            target = fresh.sharded_state_dict()
            dcp.load({"model": target}, checkpoint_id=directory)
            fresh.load_sharded_state_dict(target)
        elif load == "without extra state":
            fresh.load_state_dict({k: v for k, v in sd.items() if not k.endswith("_extra_state")}, strict=False)
        res["extra_equal"] = _same_extra(_extra(fresh), saved_extra)
        fopt = torch.optim.SGD(fresh.optimizer_parameters(), lr=0.1)  # SGD without momentum: no optimizer state
        got = _train(fresh, fopt, range(3, 6), rank)
        state = fresh.state_dict()
        res["losses_equal"] = all(torch.equal(a, b) for a, b in zip(want, got))
        res["params_equal"] = all(torch.equal(want_state[k], state[k]) for k in want_state
                                  if not k.endswith("_extra_state"))
        return res

    for load in ("state_dict", "dcp", "without extra state"):
        out[load] = resumed(load)
    # strict loading names a missing extra state, as nn.Module does
    try:
        _build(form, 1).load_state_dict({k: v for k, v in sd.items() if k != "layers.1.fc._extra_state"})
        out["strict_missing"] = None
    except RuntimeError as exc:
        out["strict_missing"] = str(exc)
    return out


@pytest.fixture(scope="module", params=["tensor", "bytes"])
def results(request, tmp_path_factory) -> List[Dict[str, Any]]:
    return run_gloo(_job, 2, str(tmp_path_factory.mktemp(f"extra-{request.param}")), request.param)


def test_state_dict_carries_extra_state_under_the_unwrapped_keys(results):
    for rank in results:
        assert rank["keys"] == ["layers.0.fc._extra_state", "layers.1.fc._extra_state"]
        assert rank["value_type"] in ("Tensor", "bytes")
        assert "layers.1.fc._extra_state" in rank["strict_missing"]


@pytest.mark.parametrize("load", ["state_dict", "dcp"])
def test_resume_from_extra_state_is_bit_exact(results, load):
    for rank in results:
        run = rank[load]
        assert run["fresh_empty"]
        assert run["extra_equal"] and run["losses_equal"] and run["params_equal"], run


def test_without_extra_state_the_resumed_run_diverges(results):
    for rank in results:
        run = rank["without extra state"]
        assert not run["extra_equal"] and not run["losses_equal"], run


@pytest.mark.parametrize("value", [torch.arange(5, dtype=torch.uint8), b"\x00raw", {"a": torch.ones(2), "n": 3}])
def test_extra_state_encoding_round_trip(value):
    encoded = encode_extra_state(value)
    assert isinstance(encoded, bytes)
    back = decode_extra_state(encoded)
    if isinstance(value, torch.Tensor):
        assert torch.equal(back, value)
    elif isinstance(value, dict):
        assert torch.equal(back["a"], value["a"]) and back["n"] == 3
    else:
        assert back == value
    assert decode_extra_state(b"\x00raw") == b"\x00raw"  # not ours: handed on as it is
    assert isinstance(io.BytesIO(encoded).read(4), bytes)
