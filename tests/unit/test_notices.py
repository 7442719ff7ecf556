"""Notices are one line, once per process, on rank 0; their detail is at DEBUG (no process group needed)."""

from __future__ import annotations

import logging

import pytest

from fsdp_cudagraph.capture import attention
from fsdp_cudagraph.engines.nvidia.hooks import DEVICE_WARNING_FILTER

MISMATCH = {"layers.0.attn": {"eager": "FusedAttention (1)", "graph": "UnfusedDotProductAttention",
                              "eager_used": "UnfusedDotProductAttention"},
            "layers.1.attn": {"eager": "FusedAttention (1)", "graph": "UnfusedDotProductAttention",
                              "eager_used": "UnfusedDotProductAttention"}}


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(attention, "_NOTICES_GIVEN", set())
    return logging.getLogger("tests.notices")


def _lines(caplog, level):
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_a_notice_is_one_line_once_per_process_on_rank_0(fresh, caplog):
    with caplog.at_level(logging.DEBUG):
        assert attention.attention_notice(MISMATCH, "match_graph", fresh, rank=0) is True
        assert attention.attention_notice(MISMATCH, "match_graph", fresh, rank=0) is False  # a second build
    warnings = _lines(caplog, logging.WARNING)
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert "2 callable(s)" in warnings[0] and "eager FusedAttention (1), under capture UnfusedDotProductAttention" \
        in warnings[0] and "pad the sequence" in warnings[0]
    debug = _lines(caplog, logging.DEBUG)
    assert len(debug) == 2 and all("layers.0.attn" in d and "layers.1.attn" in d for d in debug)  # the detail


def test_other_ranks_log_only_the_detail(fresh, caplog):
    with caplog.at_level(logging.DEBUG):
        assert attention.attention_notice(MISMATCH, "warn", fresh, rank=1) is False
        assert attention.attention_notice(MISMATCH, "warn", fresh, rank=3) is False
    assert _lines(caplog, logging.WARNING) == []
    assert len(_lines(caplog, logging.DEBUG)) == 2
    with caplog.at_level(logging.WARNING):
        assert attention.attention_notice(MISMATCH, "warn", fresh, rank=0) is True  # rank 0 still says it once
    assert "not bit-identical" in _lines(caplog, logging.WARNING)[0]


def test_a_different_notice_is_not_swallowed(fresh, caplog):
    with caplog.at_level(logging.WARNING):
        assert attention.notice_once(fresh, "first notice", rank=0)
        assert attention.notice_once(fresh, "second notice", rank=0)
        assert not attention.notice_once(fresh, "first notice", rank=0)
    assert _lines(caplog, logging.WARNING) == ["first notice", "second notice"]


def test_megatron_fsdp_device_warning_passes_once(caplog, monkeypatch):
    monkeypatch.setattr(DEVICE_WARNING_FILTER, "seen", set())
    log = logging.getLogger("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp")
    text = ("[Rank 0] Megatron-FSDP is using device cuda instead of the current device cuda:0, which may cause "
            "process-to-device mapping issues")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # three builds
            log.warning(text)
        log.warning("another Megatron-FSDP warning")
        log.warning("another Megatron-FSDP warning")
    assert _lines(caplog, logging.WARNING) == [text, "another Megatron-FSDP warning", "another Megatron-FSDP warning"]
