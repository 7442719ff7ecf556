"""benchmarks/diagnose/peak_composition.py's trace replay: the live blocks at the largest total, by site (CPU; the
GPU run records real allocator traces)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "diagnose"))

from peak_composition import peak_composition  # noqa: E402


def _frame(path: str, line: int, name: str):
    return [{"filename": f"/site-packages/{path}", "line": line, "name": name}]


def _alloc(addr: int, size: int, frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def _free(addr: int, size: int):
    return {"action": "free_completed", "addr": addr, "size": size, "frames": []}


def test_the_peak_is_the_largest_live_total_and_its_blocks_by_site():
    grads = _frame("megatron_fsdp/_unit.py", 586, "_reduce_grads")
    act = _frame("torch/nn/functional.py", 10, "linear")
    trace = [
        _alloc(1, 100, act), _alloc(2, 50, act),  # 150 live
        _free(1, 100),  # 50
        _alloc(3, 120, grads),  # 170 live: the peak, made by the gradient
        _free(2, 50), _alloc(4, 30, []),  # 150
        _alloc(5, 500, _frame("megatron_fsdp/_state_dict.py", 80, "full_state_dict")),  # after the steps: ignored
    ]
    peak, sites, made_by = peak_composition(trace)
    assert peak == 170
    assert sites == {"megatron_fsdp/_unit.py:586 _reduce_grads": 120, "nn/functional.py:10 linear": 50}  # the last two path parts
    assert made_by == "megatron_fsdp/_unit.py:586 _reduce_grads"


def test_blocks_without_a_known_frame_are_named_as_such():
    peak, sites, _ = peak_composition([_alloc(1, 64, []), _alloc(2, 8, _frame("elsewhere/x.py", 1, "f"))])
    assert peak == 72 and sites == {"no Python stack (C++: cuBLAS/TE workspaces, NCCL)": 72}
