"""Does the full-iteration host-sync check (a TorchDispatchMode that only looks) change what a step computes?

The open full-iteration row (TE model, ``no_shard``, one micro-batch, eager Adam) differs from eager at the
step that runs under :class:`~fsdp_cudagraph.capture.capture_safety.CaptureSafetyCheck`, and is equal with
``--no-host-sync-check``. This script trains the row's model two steps, then runs the third step's forward
and backward three times on the same parameters: plain, plain again (a determinism control) and under the
check, and compares every module's output and every main gradient with ``torch.equal``; a profiler lists
the kernels of the plain and the checked pass, and the script prints where they differ.

Run (1 GPU, TE installed)::

    python benchmarks/diagnose/host_sync_check.py --out diag.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
import _common  # noqa: E402 - the repository root on sys.path


def _pass(model, batch, loss_fn, modules, check):
    """One forward+backward; returns (module outputs, main grads, kernel names)."""
    import contextlib

    import torch
    from torch.profiler import ProfilerActivity, profile

    from fsdp_cudagraph.capture.capture_safety import CaptureSafetyCheck

    outs = {}
    hooks = []
    for name, m in modules:
        def rec(mod, args, out, name=name):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(t, torch.Tensor):
                outs[name] = t.detach().clone()
        hooks.append(m.register_forward_hook(rec))
    for p in model.optimizer_parameters():
        p.grad = None
    ctx = CaptureSafetyCheck(torch.device("cuda"), "the training step") if check else contextlib.nullcontext()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with ctx:
            for x, y in batch:
                loss_fn(model(x), y).backward()
        torch.cuda.synchronize()
    for h in hooks:
        h.remove()
    grads = [p.grad.detach().clone() if p.grad is not None else None for p in model.optimizer_parameters()]
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    return outs, grads, kernels


def _diff(a, b):
    first, n = None, 0
    for k in a:
        if k in b and not torch_equal(a[k], b[k]):
            n += 1
            first = first or k
    return first, n


def torch_equal(x, y):
    import torch

    return x.shape == y.shape and torch.equal(x, y)


def run(strategy: str, steps_before: int = 2):
    import torch

    from fsdp_cudagraph.capture.attention import AttentionBackendMatcher
    from fsdp_cudagraph.apps.full_iteration_align import model_config
    from fsdp_cudagraph.apps.model import GPT, loss_fn
    from fsdp_cudagraph.apps.train import rank_batches, use_deterministic_kernels
    from megatron_fsdp import fully_shard

    use_deterministic_kernels()
    device = _common.init_process_group(cuda=True, default_port=29512)
    cfg = model_config(True)
    torch.manual_seed(1234)
    gpt = GPT(cfg).to(device)
    model = fully_shard(gpt, fsdp_unit_modules=[gpt.unit_class], sharding_strategy=strategy,
                        compute_dtype=torch.bfloat16, fsdp_double_buffer=True,
                        fsdp_db_use_persist_buf_on_alloc_fail=True)
    matcher = AttentionBackendMatcher({"model": model.module}, force=True)
    opt = torch.optim.Adam(model.optimizer_parameters(), lr=1e-3)
    batches = rank_batches(cfg, steps=steps_before + 1, grad_accum=1, micro_batch_size=2, device=device, seed=1234)
    for step in range(steps_before):
        for x, y in batches[step]:
            loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    modules = [(n, m) for n, m in model.module.named_modules() if n]
    plain = _pass(model, batches[steps_before], loss_fn, modules, check=False)
    again = _pass(model, batches[steps_before], loss_fn, modules, check=False)
    checked = _pass(model, batches[steps_before], loss_fn, modules, check=True)
    matcher.uninstall()
    res = {"strategy": strategy}
    for name, other in (("plain_vs_plain", again), ("plain_vs_checked", checked)):
        first, n = _diff(plain[0], other[0])
        gdiff = [i for i, (g, h) in enumerate(zip(plain[1], other[1]))
                 if (g is None) != (h is None) or (g is not None and not torch.equal(g, h))]
        ka, kb = plain[2], other[2]
        kdiff = None
        for i, (p, q) in enumerate(zip(ka, kb)):
            if p != q:
                kdiff = {"index": i, "plain": p, "other": q, "context_plain": ka[max(0, i - 2): i + 3],
                         "context_other": kb[max(0, i - 2): i + 3]}
                break
        if kdiff is None and len(ka) != len(kb):
            kdiff = {"index": min(len(ka), len(kb)), "lengths": [len(ka), len(kb)]}
        res[name] = {"first_module_differing": first, "modules_differing": n, "grads_differing": gdiff,
                     "num_kernels": [len(ka), len(kb)], "first_kernel_difference": kdiff}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategies", nargs="+", default=["no_shard", "optim", "optim_grads_params"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("diagnose/host_sync_check.py needs a CUDA GPU and TransformerEngine (it runs the TE model of the "
              "full-iteration matrix); nothing to do on this machine")
        return 0
    results = [run(s) for s in args.strategies]
    for r in results:
        print(json.dumps(r, indent=1))
    if args.out:
        from fsdp_cudagraph.checker import records

        records.write_record(args.out, {**_common.record_fields(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
