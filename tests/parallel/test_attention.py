"""parallel.attention.SDPAttention's math against a float64 softmax attention written out here:
causal and masked padded rows, GQA, packed rows (block-diagonal causal), and the varlen call
the GPU takes for packed rows (on meta tensors: shapes and autograd)."""

from __future__ import annotations

import math

import pytest
import torch

from parallel.attention import packed_attention, packed_attention_kernel, padded_attention
from parallel.model_inputs import pack_rows

HEADS, GROUPS, DIM = 4, 2, 16
SCALE = 1 / math.sqrt(DIM)


def reference(q, k, v, allowed) -> torch.Tensor:
    """q [s, heads, d], k / v [s, groups, d], allowed [s, s] bool -> [s, heads, d] in float64."""
    k, v = (x.double().repeat_interleave(HEADS // GROUPS, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def qkv(tokens: int, batch: int | None = None, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    lead = (tokens,) if batch is None else (tokens, batch)
    return [torch.randn(*lead, n, DIM, generator=generator) for n in (HEADS, GROUPS, GROUPS)]


def test_padded_rows_causal_and_masked_with_gqa():
    q, k, v = qkv(7, batch=3)
    causal = padded_attention(q, k, v, None, True, SCALE)
    assert causal.shape == (7, 3, HEADS * DIM)
    lower = torch.ones(7, 7, dtype=torch.bool).tril()
    for b in range(3):
        want = reference(q[:, b], k[:, b], v[:, b], lower).reshape(7, -1)
        torch.testing.assert_close(causal[:, b].double(), want, atol=1e-6, rtol=0)
    # megatron's mask convention: True = masked out; here row b sees only its first 4 + b keys
    masked_out = torch.ones(3, 1, 7, 7, dtype=torch.bool)
    for b in range(3):
        masked_out[b, :, :, : 4 + b] = False
    masked = padded_attention(q, k, v, masked_out, False, SCALE)
    for b in range(3):
        want = reference(q[:, b], k[:, b], v[:, b], ~masked_out[b, 0]).reshape(7, -1)
        torch.testing.assert_close(masked[:, b].double(), want, atol=1e-6, rtol=0)


def test_packed_rows_attend_within_each_sequence_only():
    lengths = [5, 1, 3, 6]
    mask = (torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]).long()
    packed = pack_rows(torch.ones(4, 6, dtype=torch.long), mask, length=18)  # + 3 padding
    q, k, v = qkv(packed.num_tokens, seed=1)
    assert packed_attention_kernel(q) == "per_sequence"  # CPU
    got = packed_attention(q, k, v, packed.params, SCALE)
    sequence = torch.repeat_interleave(torch.arange(5), torch.tensor([5, 1, 3, 6, 3]))
    position = torch.arange(18)
    allowed = (sequence[:, None] == sequence[None, :]) & (position[None, :] <= position[:, None])
    torch.testing.assert_close(got.double(), reference(q, k, v, allowed), atol=1e-6, rtol=0)
    # ... which is each sequence alone through the padded path
    start = 0
    for n in lengths:
        alone = padded_attention(
            *(x[start : start + n, None] for x in (q, k, v)), None, True, SCALE
        )
        torch.testing.assert_close(got[start : start + n].reshape(n, -1), alone[:, 0])
        start += n


@pytest.mark.parametrize(
    "dtype, kernel", [(torch.bfloat16, "varlen"), (torch.float32, "per_sequence")]
)
def test_the_gpu_kernel_choice_and_its_varlen_call_on_meta_tensors(dtype, kernel):
    t = 12
    q, k, v = (
        torch.empty(t, n, DIM, device="meta", dtype=dtype, requires_grad=True)
        for n in (HEADS, GROUPS, GROUPS)
    )
    assert packed_attention_kernel(q) == kernel
    assert packed_attention_kernel(q[..., :12]) == "per_sequence"  # head_dim not a multiple of 8
    if kernel != "varlen":
        return
    packed = pack_rows(
        torch.ones(2, 8, dtype=torch.long), torch.tensor([[1] * 5 + [0] * 3, [1] * 7 + [0]])
    )
    params = packed.params
    params.cu_seqlens_q = params.cu_seqlens_kv = params.cu_seqlens_q.to("meta")
    out = packed_attention(q, k, v, params, SCALE)
    assert out.shape == (t, HEADS, DIM) and out.device.type == "meta"
    out.sum().backward()
    assert k.grad.shape == (t, GROUPS, DIM)  # GQA without expanding K / V
