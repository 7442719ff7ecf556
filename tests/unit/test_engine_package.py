"""[Note: one import name, two packages]: NVIDIA's standalone ``megatron-fsdp`` is imported as ``megatron_fsdp``, this
project's engine's name. Where it comes first on the path, the library refuses to use the engine, naming the path
found and the fix, instead of calling another engine's ``fully_shard`` (a TypeError on an argument, or worse, a
call that its signature happens to accept)."""

import os
import subprocess
import sys

from fsdp_cudagraph.engines.megatron_fsdp import MARKER, require_this_projects_engine
from tests.gpu_utils import ROOT

#: What stands in for NVIDIA's package: its entry point's name, other arguments.
STAND_IN = '"""megatron-fsdp as NVIDIA ships it (a stand-in)"""\n\ndef fully_shard(module, zero_dp_strategy=3):\n' \
           '    return module\n'

PROBE = """
import torch
from fsdp_cudagraph.engines.registry import engine_builder, unavailable_engines
why = unavailable_engines()
print(sorted(why))
try:
    engine_builder("megatron_fsdp", torch.device("cpu"))
except ImportError as exc:
    print("REFUSED", exc)
"""


def test_this_projects_package_is_recognised():
    assert require_this_projects_engine() == os.path.join(ROOT, "megatron_fsdp")
    with open(os.path.join(ROOT, "megatron_fsdp", "__init__.py")) as f:
        assert MARKER in f.read().splitlines()


def test_another_megatron_fsdp_first_on_the_path_is_refused_with_the_fix(tmp_path):
    shadow = tmp_path / "site" / "megatron_fsdp"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(STAND_IN)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), ROOT]))
    # from another directory: the current one comes before PYTHONPATH on sys.path
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    # the engine and the NVIDIA adapter (which reads FP8 weights through ours) are both unavailable, FSDP2 is not
    assert lines[0] == "['megatron_fsdp', 'nvidia']", proc.stdout
    refused = [line for line in lines if line.startswith("REFUSED")]
    assert len(refused) == 1, proc.stdout
    for part in (str(shadow / "__init__.py"), MARKER, "pip uninstall megatron-fsdp", "PYTHONPATH"):
        assert part in refused[0], (part, refused[0])
