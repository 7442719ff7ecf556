"""One way to run ``benchmarks/bench_engines.py --cpu-smoke`` on 2 Gloo ranks under torchrun and read its JSON."""

import json
import os
import subprocess
import sys
from typing import Any, Dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench_engines_smoke(tmp_path: Any, name: str, *args: str, timeout: int = 600) -> Dict[str, Any]:
    """Run the CPU smoke with ``args`` (``--config`` ... ``--columns`` ...), 2 warm-up and 2 timed steps, graphs
    captured at step 1; assert it exits 0 (its output tails in the message) and return the record."""
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "benchmarks", "bench_engines.py"), "--cpu-smoke", "--warmup", "2", "--steps", "2",
           "--capture-step", "1", *args, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())
