"""Bucket policy and padding (no process group)."""

import warnings

import pytest
import torch

from fsdp_cudagraph.capture.buckets import BucketOverflowWarning, Buckets, pad_to, unpad


def test_powers_of_two_and_halving():
    assert Buckets.powers_of_two(100).sizes == (1, 2, 4, 8, 16, 32, 64, 100)
    assert Buckets.powers_of_two(64, min_size=8).sizes == (8, 16, 32, 64)
    assert Buckets.halving(256, 4).sizes == (32, 64, 128, 256)
    assert Buckets.halving(3, 5).sizes == (1, 3)


def test_select_smallest_bucket_that_fits():
    b = Buckets([16, 64, 32])
    assert b.sizes == (16, 32, 64)
    assert [b.select(n) for n in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, None]


def test_overflow_warns_once_per_size_or_raises_when_strict():
    b = Buckets([8])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert b.select_or_fallback(9, what="layer") is None
        assert b.select_or_fallback(9, what="layer") is None
    assert len([x for x in w if issubclass(x.category, BucketOverflowWarning)]) == 1
    assert "size 9 exceeds the largest bucket 8" in str(w[0].message)
    with pytest.raises(ValueError, match="refused in strict mode"):
        b.select_or_fallback(9, what="layer", strict=True)


@pytest.mark.parametrize("sizes", [[], [0, 4], [2.5], [True]])
def test_bad_sizes_are_refused(sizes):
    with pytest.raises(ValueError, match="positive ints"):
        Buckets(sizes)


def test_pad_and_unpad_round_trip():
    x = torch.arange(6.0).view(2, 3)
    p = pad_to(x, 5, dim=1, value=-1.0)
    assert p.shape == (2, 5) and torch.equal(p[:, 3:], torch.full((2, 2), -1.0))
    assert torch.equal(unpad(p, 3, dim=1), x)
    assert pad_to(x, 3, dim=1) is x
    with pytest.raises(ValueError, match="larger than the target"):
        pad_to(x, 2, dim=1)
