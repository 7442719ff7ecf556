"""``--device cpu`` means CPU for FSDP2 on a machine with GPUs: every FSDP2 build passes a CPU mesh.

torch's ``fully_shard`` without ``mesh=`` builds its default mesh on the machine's accelerator
(``_fsdp_init._init_default_mesh`` asks ``torch._C._get_accelerator()``), so on a GPU machine a Gloo run would put
the model on cuda:0 while its data stays on the CPU. Here, on 2 Gloo ranks, the machine is made to look like one
with CUDA (the accelerator query and ``torch.cuda.is_available`` answer CUDA) and FSDP2's default mesh is replaced
by a tripwire; every FSDP2 build of the repository (the one builder in ``fsdp_cudagraph/engines/fsdp2/``, the
checker's builder, and the scripts and tests that train FSDP2 on the CPU) must leave every parameter on the CPU
with a mesh whose device type is ``cpu``, and never reach the tripwire. A control shows that torch's own call
without a mesh does reach it.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch

from tests.dist_utils import run_gloo

pytestmark = pytest.mark.gloo

WORLD = 2


class _DefaultMeshUsed(AssertionError):
    pass


#: What _looks_like_a_gpu_machine replaces, to give back before steps that would look for a CUDA stream.
_ORIGINAL = {"accelerator": torch._C._get_accelerator, "cuda": torch.cuda.is_available,
             "current": getattr(getattr(torch, "accelerator", None), "current_accelerator", None)}


def _looks_like_a_gpu_machine() -> None:
    """Make FSDP2's default-mesh path see CUDA, and trip if it is taken (:func:`_but_runs_on_the_cpu` gives back
    all but the tripwire)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

    torch._C._get_accelerator = lambda: torch.device("cuda")
    torch.cuda.is_available = lambda: True
    if hasattr(torch, "accelerator"):
        torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cuda")

    def tripwire(*args: Any, **kwargs: Any) -> Any:
        raise _DefaultMeshUsed("FSDP2's default mesh was asked for: on this machine it is the accelerator's (cuda), "
                               "and the model would move to cuda:0")

    _fsdp_init._init_default_mesh = tripwire
    _fsdp_init._init_default_fully_shard_mesh = tripwire
    _fully_shard._init_default_mesh = tripwire


def _but_runs_on_the_cpu() -> None:
    """Give back the CUDA look (optimizer steps on this CPU-only machine would look for a CUDA stream); FSDP2's
    default mesh stays tripped, so any build that would take the accelerator's mesh still fails."""
    torch._C._get_accelerator = _ORIGINAL["accelerator"]
    torch.cuda.is_available = _ORIGINAL["cuda"]
    if _ORIGINAL["current"] is not None:
        torch.accelerator.current_accelerator = _ORIGINAL["current"]


def _all_on_cpu(model: torch.nn.Module) -> Dict[str, Any]:
    params = list(model.parameters())
    return {"n": len(params),
            "devices": sorted({p.device.type for p in params} | {p.to_local().device.type for p in params}),
            "meshes": sorted({p.device_mesh.device_type for p in params})}


def _job(rank: int, world: int) -> Dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_cudagraph.apps.model import GPT, GPTConfig, TransformerBlock
    from fsdp_cudagraph.engines.fsdp2 import fsdp2_shard, shard_fsdp2
    from fsdp_cudagraph.engines.registry import registered_builders

    _looks_like_a_gpu_machine()
    cpu = torch.device("cpu")
    cfg = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, seq_len=8)
    out: Dict[str, Any] = {}

    control = GPT(cfg)
    try:
        torch_fully_shard(control)
        out["control"] = "no default mesh asked"
    except _DefaultMeshUsed as exc:
        out["control"] = str(exc)

    torch.manual_seed(0)
    one = GPT(cfg)
    for layer in one.layers:
        fsdp2_shard(layer)
    fsdp2_shard(one)
    out["fsdp2_shard"] = _all_on_cpu(one)

    two = GPT(cfg)
    shard_fsdp2(two, list(two.layers), device=cpu)
    out["shard_fsdp2"] = _all_on_cpu(two)

    run = registered_builders()["fsdp2"].build(
        GPT(cfg), unit_modules=[TransformerBlock], make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), device=cpu,
        sharding_strategy="optim_grads_params", compute_dtype=None)
    out["checker"] = _all_on_cpu(run.model)

    # The scripts and tests that train FSDP2 on the CPU (tests/gpu/scripts/fsdp2_storage.py --device cpu, the rotary
    # check of tests/benchmarks/test_bench_engines.py) build through the same helper.
    from tests.benchmarks.test_bench_engines import _rope_dtype_under_fsdp2_mixed_precision
    from tests.gpu.scripts.fsdp2_storage import train

    _but_runs_on_the_cpu()
    out["rope_dtype"] = _rope_dtype_under_fsdp2_mixed_precision(rank, world)
    trained = train(None, "mp", None, cpu, "protocol")
    out["script_losses_finite"] = bool(torch.isfinite(trained["losses"]).all())
    return out


def test_every_fsdp2_build_stays_on_the_cpu_of_a_gpu_machine():
    for rank, res in enumerate(run_gloo(_job, WORLD)):
        assert "default mesh was asked for" in res["control"], (rank, res["control"])
        for build in ("fsdp2_shard", "shard_fsdp2", "checker"):
            assert res[build]["n"] > 0 and res[build]["devices"] == ["cpu"], (rank, build, res[build])
            assert res[build]["meshes"] == ["cpu"], (rank, build, res[build])
        assert res["rope_dtype"] and res["script_losses_finite"], (rank, res)
