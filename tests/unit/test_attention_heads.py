"""The reference GPT's attention heads: grouped-query attention (``num_kv_heads``) and a head width of its own
(``head_dim``), the shapes of Qwen3-style models.

- defaults leave the model as it was: the same parameters and outputs as a config that spells them out;
- GQA equals multi-head attention whose key/value heads are the GQA heads repeated (computed here by hand);
- a ``head_dim`` other than ``hidden / num_heads`` gives the projections their widths;
- misuse is refused with the value and the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fsdp_cudagraph.apps.model import GPT, GPTConfig, SelfAttention

BASE = dict(vocab_size=32, hidden_size=32, num_layers=1, num_heads=4, seq_len=8)


def test_defaults_are_multi_head_attention() -> None:
    torch.manual_seed(0)
    a = GPT(GPTConfig(**BASE))
    torch.manual_seed(0)
    b = GPT(GPTConfig(num_kv_heads=4, head_dim=8, **BASE))
    tokens = torch.randint(0, 32, (2, 8))
    assert torch.equal(a(tokens), b(tokens))


def test_gqa_is_mha_with_repeated_kv_heads() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(num_kv_heads=2, head_dim=16, **BASE)  # 4 query heads of 16 (64 wide), 2 key/value heads
    attn = SelfAttention(cfg)
    assert attn.qkv.weight.shape == ((4 + 2 * 2) * 16, 32) and attn.proj.weight.shape == (32, 64)
    x = torch.randn(2, 8, 32)
    qkv = attn.qkv(attn.ln(x)).view(2, 8, 8, 16)
    q, k, v = qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:]
    k, v = (t.repeat_interleave(2, dim=2) for t in (k, v))  # query heads 0,1 share kv head 0; 2,3 share 1
    y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    want = x + attn.proj(y.transpose(1, 2).reshape(2, 8, 64))
    torch.testing.assert_close(attn(x), want, rtol=1e-6, atol=1e-6)  # SDPA's GQA kernel vs the repeat: float order
    wrong = x + attn.proj(F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, qkv[:, :, 4:6].repeat(1, 1, 2, 1), qkv[:, :, 6:].repeat(1, 1, 2, 1))),
        is_causal=True).transpose(1, 2).reshape(2, 8, 64))  # the other pairing of heads (0,2 and 1,3)
    assert (attn(x) - wrong).abs().max() > 1e-3


@pytest.mark.parametrize("kw, needle", [
    (dict(num_kv_heads=3), "num_kv_heads=3 does not divide num_heads=4"),
    (dict(num_kv_heads=0), "num_kv_heads=0"),
    (dict(num_heads=5), "set head_dim"),
])
def test_misuse_refused(kw: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        GPTConfig(**{**BASE, **kw})


def test_generator_refuses_gqa() -> None:
    from fsdp_cudagraph.apps.generate import GreedyGenerator
    from fsdp_cudagraph.config import CudaGraphConfig

    model = GPT(GPTConfig(num_kv_heads=2, **BASE)).eval()
    with pytest.raises(NotImplementedError, match="num_kv_heads=2"):
        GreedyGenerator(model, CudaGraphConfig(), max_batch=2, max_len=8)
