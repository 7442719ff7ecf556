"""``benchmarks/fp8_numerics.py``: its data is a chain a model can learn, its gap is the tail means' relative
difference, its CPU smoke run writes every curve, and on a machine without a GPU the FP8 run says what it needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.dist_utils import _free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "fp8_numerics.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import fp8_numerics  # noqa: E402


def test_every_next_token_is_one_of_its_successors():
    table = fp8_numerics.markov_table(64, 3, seed=7)
    tokens = fp8_numerics.markov_batch(table, step=5, batch_size=4, seq_len=50, seed=7)
    assert tokens.shape == (4, 51)
    for prev, nxt in zip(tokens[:, :-1].reshape(-1).tolist(), tokens[:, 1:].reshape(-1).tolist()):
        assert nxt in table[prev].tolist()
    assert torch.equal(tokens, fp8_numerics.markov_batch(table, 5, 4, 50, seed=7))  # the same on every rank
    assert not torch.equal(tokens, fp8_numerics.markov_batch(table, 6, 4, 50, seed=7))  # a new batch each step


def test_successors_out_of_range_are_refused():
    with pytest.raises(ValueError, match="successors=65: must be in 1..vocab_size"):
        fp8_numerics.markov_table(64, 65, seed=0)


def test_loss_gap_compares_the_tail_means():
    bf16 = [5.0] * 10 + [2.0, 2.0]
    fp8 = [9.0] * 10 + [2.02, 2.02]  # far apart early, 1% apart in the tail
    assert fp8_numerics.loss_gap(fp8, bf16, tail=2) == pytest.approx(0.01)
    assert fp8_numerics.loss_gap(fp8, bf16, tail=12) > 0.5
    with pytest.raises(ValueError, match="need equal lengths"):
        fp8_numerics.loss_gap(fp8[:-1], bf16, tail=2)


def test_a_run_names_its_recipe_and_whether_attention_is_fp8():
    assert fp8_numerics.parse_run("delayed") == ("delayed", False)
    assert fp8_numerics.parse_run("delayed+attention") == ("delayed", True)
    with pytest.raises(ValueError, match="optionally '\\+attention'"):
        fp8_numerics.parse_run("delayed+mha")


def _run(tmp_path, *extra):
    env = dict(os.environ, PYTHONPATH=ROOT, MASTER_PORT=str(_free_port()), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "n.json"), *extra], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)


def test_cpu_smoke_writes_the_bf16_curve(tmp_path):
    proc = _run(tmp_path, "--cpu-smoke")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "n.json").read_text())
    curve = record["curves"]["bf16"]
    assert len(curve) == 6 and all(0 < v < 10 for v in curve) and record["gaps"] == {}
    assert record["world_size"] == 1 and record["ln_successors"] == pytest.approx(1.3862943611)


def test_without_a_gpu_the_fp8_run_names_what_it_needs(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode != 0 and "FP8 runs on a CUDA GPU with TransformerEngine" in proc.stderr
    assert "--cpu-smoke" in proc.stderr
