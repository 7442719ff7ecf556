"""benchmarks/bench_peers.py on CPU: its smoke run, and the Megatron-FSDP process's model load that must keep our
``megatron_fsdp`` (same name as NVIDIA's PyPI package) out of that process."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_peers.py")

ISOLATED_LOAD = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("bench_peers", {SCRIPT!r})
bp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bp)
code = bp.load_model_code(isolated=True)
gpt = code.model.GPT(code.model.GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, seq_len=8))
leaked = sorted(m for m in sys.modules if m == "megatron_fsdp" or m.startswith("megatron_fsdp.")
                or m.startswith("fsdp_cudagraph.") and m not in ("fsdp_cudagraph.capture", "fsdp_cudagraph.apps",
                                                                  "fsdp_cudagraph.capture.te", "fsdp_cudagraph.capture.fp8",
                                                                  "fsdp_cudagraph.apps.model",
                                                                  "fsdp_cudagraph.apps.moe",
                                                                  "fsdp_cudagraph.apps.moe_ep",
                                                                  "fsdp_cudagraph.apps.tp"))
print(leaked, sum(p.numel() for p in gpt.parameters()))
"""


def test_isolated_model_load_imports_neither_our_engine_nor_the_package():
    # from a folder outside the repository, without it on sys.path: as the Megatron-FSDP process runs
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", ISOLATED_LOAD], capture_output=True, text=True, cwd="/", env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    leaked, numel = p.stdout.split("]")
    assert leaked == "[" and int(numel) > 0, p.stdout


def test_cpu_smoke_run_of_our_engine(tmp_path):
    out = tmp_path / "ours.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT, "--engine",
           "ours", "--device", "cpu", "--hidden", "64", "--layers", "2", "--seq", "32", "--steps", "3", "--warmup",
           "1", "--vocab", "256", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rec = json.loads(out.read_text())
    losses = rec["losses"]
    assert len(losses) == 4 and losses[-1] < losses[0], rec
