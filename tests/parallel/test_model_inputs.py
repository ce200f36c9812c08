"""parallel.model_inputs: one packed row per micro-batch (THD, cu_seqlens, positions restarting
per sequence, in-sequence labels) and its outputs back in the padded per-row layout."""

from __future__ import annotations

import torch

from parallel.model_inputs import pack_rows, packed_inputs, padded_inputs
from parallel.step_types import MicroBatch


def right_padded(lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = (torch.arange(1, width + 1)[None, :] + 100 * torch.arange(len(lengths))[:, None]) * mask
    return ids, mask


def test_pack_rows_lays_real_tokens_end_to_end():
    ids, mask = right_padded([3, 1, 2], width=4)
    packed = pack_rows(ids, mask)
    assert packed.input_ids.tolist() == [[1, 2, 3, 101, 201, 202]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    # next token within the sequence; each last token is a stand-in (itself)
    assert packed.labels.tolist() == [[2, 3, 3, 101, 202, 202]]
    params = packed.params
    assert params.qkv_format == "thd" and params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == [0, 3, 4, 6] and params.max_seqlen_q == 3
    assert params.cu_seqlens_kv is params.cu_seqlens_q
    assert packed.starts.tolist() == [0, 3, 4] and packed.lengths.tolist() == [3, 1, 2]


def test_padding_of_a_packed_row_is_a_sequence_of_its_own():
    ids, mask = right_padded([3, 2], width=3)
    packed = pack_rows(ids, mask, length=7, multiple=4)  # 5 real tokens -> 8
    assert packed.num_tokens == 8
    assert packed.params.cu_seqlens_q.tolist() == [0, 3, 5, 8]
    assert packed.params.max_seqlen_q == 3
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]


def test_unpack_gives_the_padded_layout_with_zeros_past_each_row():
    ids, mask = right_padded([3, 1, 2], width=4)
    packed = pack_rows(ids, mask)
    per_token = torch.tensor([[10.0, 11, 12, 20, 30, 31]], requires_grad=True)
    values = packed.unpack(per_token, width=4)
    assert values.tolist() == [[10, 11, 12, 0], [20, 0, 0, 0], [30, 31, 0, 0]]
    next_token = packed.unpack(per_token, width=3, shift=1)  # log-probs: [mb, S-1]
    assert next_token.tolist() == [[10, 11, 0], [0, 0, 0], [30, 0, 0]]
    next_token.sum().backward()
    # the stand-in labels at sequence ends get no gradient
    assert per_token.grad.tolist() == [[1, 1, 0, 0, 1, 0]]


def test_model_inputs_share_one_shape_under_pipeline_parallelism():
    first, second = right_padded([3, 2], width=3), right_padded([1, 1, 1], width=1)
    batches = [MicroBatch(input_ids=i, attention_mask=m) for i, m in (first, second)]
    packed = packed_inputs(batches, common_length=True, multiple=2)
    assert [p.input_ids.shape for p in packed] == [(1, 6), (1, 6)]  # 5 and 3 real tokens
    assert [p.packed.lengths.tolist() for p in packed] == [[3, 2], [1, 1, 1]]
    alone = packed_inputs(batches, common_length=False)
    assert [p.input_ids.shape[1] for p in alone] == [5, 3]
    same_rows = [
        MicroBatch(input_ids=i, attention_mask=m) for i, m in (first, right_padded([1, 1], 1))
    ]
    padded = padded_inputs(same_rows, common_length=True)
    assert [tuple(p.input_ids.shape) for p in padded] == [(2, 3), (2, 3)]
    assert padded[1].position_ids.tolist() == [[0, 1, 2], [0, 1, 2]]
