"""The no-grad passes over a batch of rows: log-probs of a policy model, values of a value model,
with MoE routing recorded or replayed. Each cuts the rows into micro-batches
(``parallel.micro_batches``), runs them forward only through ``parallel.schedule.forward_backward``
and puts each row's output back at its row.

    forward_log_probs(models, mesh, input_ids, attention_mask, micro_batch_size, ...) -> [b, S-1]
    forward_log_probs_and_routing(..., replay=None) -> ([b, S-1], RoutingNotes)
    forward_top_log_probs(..., top_k) -> ([b, S-1], [b, S-1, k], [b, S-1, k])
    forward_values(models, mesh, input_ids, attention_mask, micro_batch_size, ...) -> [b, S]
"""

from __future__ import annotations

import torch

from parallel.cpu_compat import device
from parallel.mesh import Mesh
from parallel.micro_batches import micro_batches
from parallel.routing_replay import RoutingNotes
from parallel.schedule import forward_backward
from parallel.step_types import MicroBatch


def forward_log_probs(
    models: list[torch.nn.Module],
    mesh: Mesh,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    micro_batch_size: int,
    temperature: float = 1.0,
    max_tokens: int = 0,
    pack_sequences: bool = False,
) -> torch.Tensor:
    """Log-probs ``[b, S-1]`` of ``input_ids[:, 1:]`` (float32, on every model-parallel rank).

    ``input_ids`` / ``attention_mask`` are ``[b, S]``, right-padded. Positions whose label is
    padding hold meaningless values; mask them with ``attention_mask[:, 1:]``. ``max_tokens``
    > 0 cuts micro-batches by a token budget instead of ``micro_batch_size`` (``micro_batches``);
    ``pack_sequences`` packs each micro-batch's sequences up to that budget into one row.
    """
    args = (micro_batch_size, temperature, max_tokens, pack_sequences)
    return _forward_rows(models, mesh, input_ids, attention_mask, *args)[0]["log_probs"]


def forward_top_log_probs(
    models: list[torch.nn.Module],
    mesh: Mesh,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    micro_batch_size: int,
    top_k: int,
    temperature: float = 1.0,
    max_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``forward_log_probs``'s ``[b, S-1]`` and each position's ``top_k`` likeliest tokens:
    their log-probs ``[b, S-1, top_k]`` (float32) and ids (int64), likeliest first, over the
    whole vocabulary (``parallel.logprobs.vocab_parallel_top_ids``). Padded rows only."""
    args = (micro_batch_size, temperature, max_tokens, False)
    out = _forward_rows(models, mesh, input_ids, attention_mask, *args, top_k=top_k)[0]
    return out["log_probs"], out["top_log_probs"], out["top_ids"]


def forward_log_probs_and_routing(
    models: list[torch.nn.Module],
    mesh: Mesh,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    micro_batch_size: int,
    temperature: float = 1.0,
    max_tokens: int = 0,
    pack_sequences: bool = False,
    replay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, RoutingNotes]:
    """``forward_log_probs`` that records the experts of every token in this rank's MoE layers
    (``notes.recorded [b, S, L, k]``, for a later forward of these rows to replay), or with
    ``replay [b, S, L, k]`` sends every token to those experts and counts where the router's own
    choice differed (``notes.changed``) (``parallel.routing_replay``)."""
    args = (micro_batch_size, temperature, max_tokens, pack_sequences)
    out, notes = _forward_rows(
        models, mesh, input_ids, attention_mask, *args, record_routing=replay is None,
        replay=replay,
    )  # fmt: skip
    return out["log_probs"], notes


def forward_values(
    models: list[torch.nn.Module],
    mesh: Mesh,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    micro_batch_size: int,
    max_tokens: int = 0,
    pack_sequences: bool = False,
) -> torch.Tensor:
    """A value model's outputs ``[b, S]`` (float32, on every model-parallel rank); as
    ``forward_log_probs`` otherwise (values on padding are meaningless)."""
    return _forward_rows(
        models, mesh, input_ids, attention_mask, micro_batch_size, 1.0, max_tokens, pack_sequences
    )[0]["values"]


def _forward_rows(
    models: list[torch.nn.Module],
    mesh: Mesh,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    micro_batch_size: int,
    temperature: float,
    max_tokens: int,
    pack_sequences: bool,
    record_routing: bool = False,
    replay: torch.Tensor | None = None,
    top_k: int = 0,
) -> tuple[dict[str, torch.Tensor], RoutingNotes]:
    """The no-grad forward of a batch, micro-batched, each row's outputs put back at its row, by
    name (``ModelOutputs``'s): ``log_probs`` of a policy model (and ``top_log_probs`` /
    ``top_ids`` with ``top_k``) or ``values`` of a value model, ``[b, <= S, ...]`` on device();
    the routing recorded or replayed (``forward_log_probs_and_routing``)."""
    batch = input_ids.shape[0]
    rows = MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        row_index=torch.arange(batch),
        routing=replay,
    )
    chunks = micro_batches(
        rows,
        micro_batch_size,
        equal_sizes=mesh.pp > 1,
        max_tokens=max_tokens,
        pack=pack_sequences,
    )
    results = forward_backward(
        models, mesh, chunks, None, forward_only=True, temperature=temperature, top_k=top_k,
        pack_sequences=pack_sequences, record_routing=record_routing,
    )  # fmt: skip
    out: dict[str, torch.Tensor] = {}
    notes = RoutingNotes()
    for chunk, result in zip(chunks, results, strict=True):
        notes.add(result, chunk.row_index, input_ids.shape)
        for name, per_row in result.outputs.filled().items():
            if name not in out:  # log-probs score S-1 next tokens, values all S positions
                width = input_ids.shape[1] - (0 if name == "values" else 1)
                shape = (batch, width, *per_row.shape[2:])
                out[name] = torch.zeros(shape, dtype=per_row.dtype, device=device())
            # Filler rows of an equal-size last micro-batch repeat a real row: writing it twice
            # is harmless (same input, same values).
            out[name][chunk.row_index.to(device()), : per_row.shape[1]] = per_row
    return out, notes
