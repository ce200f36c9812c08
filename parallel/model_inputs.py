"""A micro-batch as the model sees it: right-padded rows, or ONE packed row of its sequences
laid end to end (megatron's THD layout) whose per-token outputs are put back per row.

    padded_inputs(micro_batches, common_length, multiple) -> [ModelInputs on device()]
        rows right-padded to the call's longest S (common_length: pipeline parallelism exchanges
        one activation shape per call), S rounded up to a multiple of ``multiple`` (sequence
        parallelism splits S over the TP ranks)
    packed_inputs(micro_batches, common_length, multiple) -> [ModelInputs on device()]
        likewise, one packed row per micro-batch (``packed`` set, no ``attention_mask``)

``micro_batches`` are ``parallel.step_types.MicroBatch`` es; a new model input is a field there
and the lines here that lay it out (pad it, or pack its real tokens like ``input_ids``): the MoE
routing a forward replays (``routing [mb, S, L, k]``) becomes ``ModelInputs.routing [tokens, L,
k]`` in the model's token order, and ``ModelInputs.per_row`` puts per-token values of that order
back per row (``parallel.routing_replay``); a vision-language model's images (``pixel_values``,
``image_grid_thw``, per row) become ``ModelInputs.images``, every row's own in row order, and its
multimodal positions ``[mb, S, 3]`` megatron's ``[3, mb, S]`` (padded rows only).

    packed = pack_rows(input_ids [mb, S], attention_mask [mb, S], length=None, multiple=1)
    model(packed.input_ids, packed.position_ids, attention_mask=None,
          packed_seq_params=packed.params)                 # logits [1, t, V/tp] / values [1, t]
    per_row = packed.unpack(per_token [1, t], width, shift)   # [mb, width]

Only real tokens are packed: row r's ``lengths[r]`` tokens (its ``attention_mask`` row sum; rows
are right-padded) start at ``starts[r]``. ``params`` is megatron-core's ``PackedSeqParams``
(``qkv_format="thd"``, int32 ``cu_seqlens`` over the sequences): attention stays inside each
sequence (``parallel.attention.SDPAttention`` or TE's attention) and megatron's rotary embedding
takes its pure-PyTorch THD path (``_apply_rotary_pos_emb_thd``, used when ``cu_seqlens`` is
given and RoPE fusion is off), whose positions restart at every sequence start, as
``position_ids`` do. A row padded to ``length`` (pipeline parallelism needs one activation shape
per call; sequence parallelism a multiple of tp) gets the padding as one more sequence in
``cu_seqlens``, attending only to itself, so the real sequences never see it.

``labels`` hold each token's next token within its sequence (a stand-in at sequence ends, whose
log-prob ``unpack(..., shift=1)`` drops), so per-token log-probs of the packed row unpack into
exactly the ``[mb, S-1]`` layout of the padded path; values unpack with ``shift=0`` into
``[mb, S]``. Positions past a row's own length hold 0 (the padded path holds meaningless values
there; every loss masks them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from parallel.cpu_compat import device
from parallel.step_types import MicroBatch
from parallel.vision_language import ImageInputs


@dataclass
class PackedRows:
    """One packed row of a micro-batch (module docstring); tensors on the inputs' device."""

    input_ids: torch.Tensor  # [1, t] int64
    position_ids: torch.Tensor  # [1, t] int64, restarting at 0 per sequence
    labels: torch.Tensor  # [1, t] int64, the next token within the sequence
    params: PackedSeqParams
    starts: torch.Tensor  # [mb] int64, where each row's tokens start in the packed row
    lengths: torch.Tensor  # [mb] int64, each row's real tokens

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def unpack(self, per_token: torch.Tensor, width: int, shift: int = 0) -> torch.Tensor:
        """``[1, t]`` (or ``[t]``) per-token values -> ``[mb, width]`` per row: entry ``[r, j]``
        is the value at row r's position j, for ``j < lengths[r] - shift``, else 0. Autograd
        flows back to the packed tensor (zero gradient for the dropped entries)."""
        flat = per_token.reshape(-1)
        offsets = torch.arange(width, device=flat.device)
        index = (self.starts[:, None] + offsets[None, :]).clamp(max=flat.numel() - 1)
        valid = offsets[None, :] < (self.lengths - shift)[:, None]
        return torch.where(
            valid, flat[index], torch.zeros((), dtype=flat.dtype, device=flat.device)
        )

    def rows(self, per_token: torch.Tensor, width: int) -> torch.Tensor:
        """``[t, ...]`` per-token values -> ``[mb, width, ...]``: row r's tokens at positions
        ``j < lengths[r]``, 0 past them (no autograd use)."""
        offsets = torch.arange(width, device=per_token.device)
        index = (self.starts[:, None] + offsets[None, :]).clamp(max=per_token.shape[0] - 1)
        valid = offsets[None, :] < self.lengths[:, None]
        out = per_token[index]
        return out * valid.reshape(*valid.shape, *[1] * (out.dim() - 2)).to(out.dtype)


@dataclass
class ModelInputs:
    """One micro-batch laid out for the model, on ``device()``: ``[mb, S]`` right-padded rows
    (``attention_mask`` 1 on real tokens, ``packed`` None) or one packed row ``[1, t]``
    (``packed`` set, ``attention_mask`` None)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    packed: PackedRows | None = None
    routing: torch.Tensor | None = None  # [tokens, L, k] int64: the experts to replay
    images: ImageInputs | None = None  # a vision-language model's, in row order

    def per_row(self, per_token: torch.Tensor, width: int) -> torch.Tensor:
        """``[tokens, ...]`` values in the model's token order (megatron's ``[S, mb]`` flattened
        S-major, or the packed row) -> ``[mb, width, ...]`` per row."""
        if self.packed is not None:
            return self.packed.rows(per_token, width)
        rows, length = self.input_ids.shape
        per_position = per_token.reshape(length, rows, *per_token.shape[1:])
        return per_position.transpose(0, 1)[:, :width]


def routing_tokens(mb: MicroBatch, inputs: ModelInputs) -> torch.Tensor:
    """``mb.routing [mb, S, L, k]`` laid out as ``inputs`` runs: ``[tokens, L, k]`` int64 on
    ``device()``; tokens without a recorded choice (padding, or -1: a token the recording never
    read) replay experts ``0..k-1``."""
    routing = mb.routing.to(device()).long()
    k = routing.shape[-1]
    real = mb.attention_mask.to(device()).bool()
    filler = torch.arange(k, device=routing.device)
    routing = torch.where(routing >= 0, routing, filler)
    if inputs.packed is not None:
        chosen = routing[real]  # row-major real tokens, as pack_rows lays them out
        missing = inputs.packed.num_tokens - chosen.shape[0]
        return torch.cat([chosen, filler.expand(missing, chosen.shape[1], k)])
    routing = torch.where(real[:, :, None, None], routing, filler)
    rows, length = inputs.input_ids.shape
    if length > routing.shape[1]:
        extra = filler.expand(rows, length - routing.shape[1], routing.shape[2], k)
        routing = torch.cat([routing, extra], dim=1)
    return routing.transpose(0, 1).reshape(length * rows, *routing.shape[2:])


def row_images(mb: MicroBatch) -> ImageInputs | None:
    """``mb.pixel_values [mb, P, D]`` / ``image_grid_thw [mb, I, 3]`` as the vision tower takes
    them: every row's own patches and grids, in row order, on ``device()``; None when its rows
    hold no image (text rows of a vision-language batch)."""
    patches, grids = [], []
    for pixels, grid in zip(mb.pixel_values, mb.image_grid_thw, strict=True):
        grid = grid[grid.prod(dim=-1) > 0]
        patches.append(pixels[: int(grid.prod(dim=-1).sum())])
        grids.append(grid)
    if not sum(len(grid) for grid in grids):
        return None
    row_patches = tuple(len(row) for row in patches)
    return ImageInputs(torch.cat(patches), torch.cat(grids).long(), row_patches).to(device())


def model_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """``[mb, S]`` positions as they are, multimodal ``[mb, S, 3]`` as megatron's ``[3, mb, S]``."""
    return position_ids.permute(2, 0, 1) if position_ids.dim() == 3 else position_ids


def packed_length(attention_mask: torch.Tensor) -> int:
    """Tokens of a micro-batch's packed row before any padding: its real tokens."""
    return int(attention_mask.sum())


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    length: int | None = None,
    multiple: int = 1,
) -> PackedRows:
    """Pack the real tokens of right-padded ``[mb, S]`` rows into one row of ``length`` tokens
    (default: just the real ones), rounded up to a multiple of ``multiple``."""
    device = input_ids.device
    lengths = attention_mask.sum(dim=1).to(device=device, dtype=torch.long)
    real = int(lengths.sum())
    total = max(real, length or 0)
    total = -(-max(total, 1) // multiple) * multiple
    keep = torch.arange(input_ids.shape[1], device=device)[None, :] < lengths[:, None]
    tokens = input_ids[keep]  # row-major: row 0's tokens, then row 1's, ...
    seqlens = [n for n in lengths.tolist() if n > 0]
    if total > real:
        seqlens.append(total - real)  # the padding: a sequence of its own
        tokens = torch.cat([tokens, tokens.new_zeros(total - real)])
    seqlens_t = torch.tensor(seqlens, dtype=torch.long, device=device)
    cu_seqlens = torch.zeros(len(seqlens) + 1, dtype=torch.int32, device=device)
    cu_seqlens[1:] = seqlens_t.cumsum(0)
    sequence_start = torch.repeat_interleave(cu_seqlens[:-1].long(), seqlens_t)
    position_ids = torch.arange(total, device=device) - sequence_start
    sequence_end = torch.repeat_interleave(cu_seqlens[1:].long(), seqlens_t)
    following = torch.cat([tokens[1:], tokens[:1]])
    # the last token of a sequence has no next token in it: a stand-in (its own id)
    labels = torch.where(torch.arange(total, device=device) + 1 < sequence_end, following, tokens)
    max_seqlen = max(seqlens)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )
    starts = torch.cumsum(lengths, 0) - lengths
    return PackedRows(
        input_ids=tokens[None, :],
        position_ids=position_ids[None, :],
        labels=labels[None, :],
        params=params,
        starts=starts,
        lengths=lengths,
    )


def padded_inputs(
    micro_batches: list[MicroBatch], common_length: bool, multiple: int = 1
) -> list[ModelInputs]:
    """Right-padded model inputs on ``device()`` (module docstring); a micro-batch's own
    ``position_ids`` are kept (default ``arange(S)``)."""
    lengths = [mb.input_ids.shape[1] for mb in micro_batches]
    sizes = {mb.input_ids.shape[0] for mb in micro_batches}
    if common_length and len(sizes) > 1:
        raise ValueError(f"pipeline parallelism needs equal micro-batch sizes, got {sorted(sizes)}")
    # Without pipeline parallelism nothing exchanges activations: each micro-batch keeps its own S.
    common = max(lengths) if common_length else 0
    padded = []
    for mb, length in zip(micro_batches, lengths, strict=True):
        ids = mb.input_ids.to(device())
        position_ids = mb.position_ids
        if position_ids is None:
            position_ids = torch.arange(length, device=ids.device).expand(ids.shape[0], -1)
        position_ids = position_ids.to(device())
        target = -(-max(common, length) // multiple) * multiple
        extra = target - length
        if extra > 0:
            steps = torch.arange(1, extra + 1, device=ids.device)
            steps = steps[:, None] if position_ids.dim() == 3 else steps
            position_ids = torch.cat([position_ids, position_ids[:, -1:] + steps], dim=1)
        inputs = ModelInputs(
            input_ids=torch.nn.functional.pad(ids, (0, extra)),
            position_ids=model_positions(position_ids),
            attention_mask=torch.nn.functional.pad(mb.attention_mask.to(device()), (0, extra)),
        )
        if mb.routing is not None:
            inputs.routing = routing_tokens(mb, inputs)
        if mb.pixel_values is not None:
            inputs.images = row_images(mb)
        padded.append(inputs)
    return padded


def packed_inputs(
    micro_batches: list[MicroBatch], common_length: bool, multiple: int = 1
) -> list[ModelInputs]:
    """One packed row per micro-batch on ``device()`` (module docstring); positions restart at
    every sequence (a micro-batch's own ``position_ids`` are not used)."""
    common = max(packed_length(mb.attention_mask) for mb in micro_batches) if common_length else 0
    inputs = []
    for mb in micro_batches:
        if mb.pixel_values is not None:
            raise ValueError("packed micro-batches carry no images yet: run them padded")
        packed = pack_rows(
            mb.input_ids.to(device()), mb.attention_mask.to(device()), common, multiple
        )
        laid_out = ModelInputs(packed.input_ids, packed.position_ids, packed=packed)
        if mb.routing is not None:
            laid_out.routing = routing_tokens(mb, laid_out)
        inputs.append(laid_out)
    return inputs
