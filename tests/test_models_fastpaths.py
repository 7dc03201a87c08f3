"""The decode fast paths of minihf.models against their plain references.

RopeTable (cos/sin looked up instead of recomputed) against transformers' formula, and the
fp32 RMSNorm (no casts) against HF's order. Whole-model parity with transformers is in
test_models_parity.py; these pin each piece so a regression names its culprit.
"""

import pytest
import torch

from minihf.models import ModelArgs
from minihf.models.layers import RMSNorm
from minihf.models.rope import RopeTable, apply_rope, inv_freq

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _reference_rope(x, args, positions):
    """transformers' rotation: angles = pos * inv_freq, x * cos + rotate_half(x) * sin."""
    angles = positions[..., None].float() * inv_freq(args)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_rope_table_matches_reference_and_grows_on_cpu(scaling):
    args = ModelArgs(head_dim=16, rope_theta=5e5, rope_scaling=scaling, max_position_embeddings=64)
    table = RopeTable(args)
    x = torch.randn(3, 4, 5, 16)
    for positions in (torch.arange(5).expand(3, 5), torch.tensor([[0, 1, 2, 9, 40]] * 3),
                      torch.full((3, 5), 700)):  # 700: past both the first table and max_position
        cos, sin = table(positions, torch.float32)
        # the same fp32 angles and ops, but cos/sin may come from SLEEF or libm (each <= 1 ulp,
        # 1.2e-7): with |x| < ~4 the worst case is ~1e-6 over the two terms and their roundings,
        # so 2e-6 holds on any host (a bound, not a measurement; bitwise if both take one path)
        torch.testing.assert_close(apply_rope(x, cos, sin), _reference_rope(x, args, positions),
                                   atol=2e-6, rtol=0)
    assert table.cos.shape[0] >= 701
    cos, _ = table(torch.zeros(1, 1, dtype=torch.long), torch.float64)  # new dtype: rebuilt
    assert cos.dtype == torch.float64 and table.key == (torch.device("cpu"), torch.float64)
    table.reserve(2000)
    table._build(torch.device("cpu"), torch.float32, 1)
    assert table.cos.shape[0] == 256  # CPU still grows on demand, from a small table
    table._build(torch.device("meta"), torch.float32, table.min_len)
    assert table.cos.shape[0] == 2000  # other devices: the reserved length, once


def test_fp32_rmsnorm_equals_hf_order():
    norm = RMSNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24))
    x = torch.randn(3, 7, 24) * 5
    hf = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(norm(x), hf, atol=1e-6, rtol=1e-6)  # same ops, same order: bitwise
    # bf16 keeps HF's casts: normalise in fp32, cast, then scale
    xb, nb = x.bfloat16(), RMSNorm(24, eps=1e-5).bfloat16()
    ref = nb.weight * (x.bfloat16().float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True)
                                                         + 1e-5)).bfloat16()
    assert torch.equal(nb(xb), ref)
