"""The rollout batch: samples from the engine -> one typed batch of right-padded tensors.

``RolloutBatch`` is the step's data: the fields the rollout fills, and the fields each later
phase adds (old / reference log-probs, values, advantages, returns), each with its shape and
meaning in one place. ``B`` sequences, ``S`` = longest prompt + response, ``R`` = longest
response. Prompt then response, right-padded, so plain causal attention is exact and position
ids are ``arange(S)``. Every algorithm works on ``[B, R]`` tensors.

Groups (all ``n`` samples of one prompt) stay whole: data-parallel ranks receive whole groups,
balanced by token count (``take_dp_share``), and mini-batches split along groups too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from parallel.step_types import MicroBatch, response_field, row_field, sequence_field
from rlcli.data import PromptItem

if TYPE_CHECKING:
    from rlcli.rollout.trajectory import TrajectoryRecord


@dataclass
class Sample:
    """One sampled response and everything the step computes about it."""

    group: int  # which prompt of this step it answers
    prompt_ids: list[int]
    response_ids: list[int]
    engine_log_probs: list[float]  # per response token (0.0 on tokens the model did not generate)
    finish_reason: str
    item: PromptItem | None  # data_source, ground_truth, extra_info (None for SFT pairs)
    score: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)  # the reward function's extra fields
    reward_baseline: float = 0.0  # ReMax: the score of this prompt's greedy answer
    # Per response token: 1 where the model generated it, 0 where a tool or environment wrote it
    # (multi-turn). None: every response token was generated (a single-turn answer).
    loss_mask: list[int] | None = None
    # Multi-turn: the trajectory's messages, tool calls and budget cut (None: single-turn).
    trajectory: TrajectoryRecord | None = None
    weight_version: int = 0  # the weights that generated it: those after this step's update
    # (the run's first step - 1 for the weights it starts with)
    staleness: int = 0  # weight versions between those and the trainer's when it trains on it
    # Per response token: an engine teacher's log-prob of it (distill.teacher.engine=vllm / hf;
    # None: no such teacher, or a Megatron one, which fills the batch's field itself).
    teacher_log_probs: list[float] | None = None
    # [len(response_ids), k]: at the position that predicts each response token, an engine
    # teacher's k likeliest tokens' log-probs and ids (a top-k objective; None otherwise).
    teacher_top_log_probs: torch.Tensor | None = None
    teacher_top_ids: torch.Tensor | None = None
    # [num_tokens - 1, L, k] int16: the engine's experts for every token it read (R3:
    # model.moe_routing_replay=r3; None otherwise)
    routing: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(kw_only=True)
class RolloutBatch(MicroBatch):
    """One step's samples (this rank's share) as tensors; see the module docstring. A
    ``parallel.step_types.MicroBatch``: ``parallel.micro_batches`` cuts it into micro-batches of
    this type by the axis each field declares, and a loss function reads them as such.

    Filled at collation (the rollout's results):

    - ``input_ids [B, S]`` int64, ``attention_mask [B, S]`` int64 (1 on real tokens).
    - ``response_index [B, R]`` int64: for response token ``j`` of row ``b``, the position in the
      Megatron per-position output ``[B, S-1]`` that scores it (``prompt_len - 1 + j``; 0 on
      padding).
    - ``response_mask [B, R]`` float32: 1 on the response's positions (generated or not).
    - ``loss_mask [B, R]`` float32: 1 on the tokens the model generated, the only ones that get a
      loss, a KL term, an entropy bonus, an advantage or a log-prob check (equal to
      ``response_mask`` for single-turn answers; 0 on tool / environment tokens).
    - ``engine_log_probs [B, R]`` float32: the engine's log-probs of the sampled tokens (the
      behaviour policy); 0 where ``loss_mask`` is 0.
    - ``group_index [B]`` int64, ``scores [B]`` and ``reward_baselines [B]`` float32.
    - ``trajectory_index [B]`` int64: the rows of one trajectory share it (an agent's trajectory
      split into segments: ``rlcli.rollout.agents.capture``); otherwise every row has its own.
    - ``staleness [B]`` int64: weight versions between the weights that generated the row and
      the trainer's (0: on-policy; up to ``trainer.max_staleness`` with asynchronous rollouts).

    Filled by the phases (None until then; ``require`` names the missing phase):
    ``old_log_probs`` (old_log_prob), ``ref_log_probs`` (ref), ``teacher_log_probs`` (teacher:
    on-policy distillation's teacher on the sampled tokens), ``values`` (values),
    ``token_level_rewards``, ``advantages``, ``returns`` (adv), all ``[B, R]`` float32. With a
    top-k distillation objective the teacher phase also fills ``teacher_top_log_probs [B, S, k]``
    (float32) and ``scored_ids [B, S, k]`` (MicroBatch's: the teacher's likeliest tokens at each
    position, whose log-probs the update's forward then gives; the last position holds zeros).
    """

    # input_ids, attention_mask (and the unused position_ids, row_index): MicroBatch's.
    response_mask: torch.Tensor = response_field(mask=True)
    loss_mask: torch.Tensor = response_field(mask=True)
    response_index: torch.Tensor = response_field()
    engine_log_probs: torch.Tensor = response_field()
    group_index: torch.Tensor = row_field()
    trajectory_index: torch.Tensor = row_field()
    scores: torch.Tensor = row_field()
    reward_baselines: torch.Tensor = row_field()
    staleness: torch.Tensor = row_field()
    old_log_probs: torch.Tensor | None = response_field(default=None)
    ref_log_probs: torch.Tensor | None = response_field(default=None)
    teacher_log_probs: torch.Tensor | None = response_field(default=None)
    teacher_top_log_probs: torch.Tensor | None = sequence_field(default=None)
    values: torch.Tensor | None = response_field(default=None)
    token_level_rewards: torch.Tensor | None = response_field(default=None)
    advantages: torch.Tensor | None = response_field(default=None)
    returns: torch.Tensor | None = response_field(default=None)

    @property
    def agreement_mask(self) -> torch.Tensor:
        """``[B, R]``: the generated tokens of the rows the trainer's current weights generated,
        where the trainer's and the engine's log-probs must agree (stale rows differ by design)."""
        return self.loss_mask * (self.staleness == 0).to(self.loss_mask.dtype).unsqueeze(-1)

    def require(self, name: str) -> torch.Tensor:
        """The field ``name``; a clear error when the phase that fills it has not run."""
        value = getattr(self, name)
        if value is None:
            raise RuntimeError(f"the batch has no {name}: the phase that computes it did not run")
        return value


def collate(samples: list[Sample], pad_id: int) -> RolloutBatch:
    """The batch of a list of samples (see ``RolloutBatch`` for the layout)."""
    batch = len(samples)
    seq_len = max(s.num_tokens for s in samples)
    resp_len = max(1, max(len(s.response_ids) for s in samples))
    input_ids = torch.full((batch, seq_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, seq_len), dtype=torch.long)
    response_index = torch.zeros((batch, resp_len), dtype=torch.long)
    response_mask = torch.zeros((batch, resp_len), dtype=torch.float32)
    loss_mask = torch.zeros((batch, resp_len), dtype=torch.float32)
    engine_log_probs = torch.zeros((batch, resp_len), dtype=torch.float32)
    for row, s in enumerate(samples):
        tokens = s.prompt_ids + s.response_ids
        input_ids[row, : len(tokens)] = torch.tensor(tokens)
        attention_mask[row, : len(tokens)] = 1
        n_resp = len(s.response_ids)
        response_index[row, :n_resp] = torch.arange(n_resp) + len(s.prompt_ids) - 1
        response_mask[row, :n_resp] = 1.0
        if s.loss_mask is None:
            loss_mask[row, :n_resp] = 1.0
        else:
            loss_mask[row, :n_resp] = torch.tensor(s.loss_mask[:n_resp], dtype=torch.float32)
        engine_log_probs[row, :n_resp] = torch.tensor(
            s.engine_log_probs[:n_resp], dtype=torch.float32
        )
    return RolloutBatch(
        **_images(samples, seq_len),
        routing=_engine_routing(samples, seq_len),
        teacher_log_probs=_teacher_log_probs(samples, resp_len),
        **_teacher_top(samples, seq_len),
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_index=response_index,
        response_mask=response_mask,
        loss_mask=loss_mask,
        engine_log_probs=engine_log_probs,
        group_index=torch.tensor([s.group for s in samples], dtype=torch.long),
        trajectory_index=_trajectory_index(samples),
        scores=torch.tensor([s.score for s in samples], dtype=torch.float32),
        reward_baselines=torch.tensor([s.reward_baseline for s in samples], dtype=torch.float32),
        staleness=torch.tensor([s.staleness for s in samples], dtype=torch.long),
    )


def _trajectory_index(samples: list[Sample]) -> torch.Tensor:
    """``[B]``: one id per trajectory, shared by the segments of a split agent trajectory."""
    ids: dict[object, int] = {}
    index = []
    for row, s in enumerate(samples):
        agent = s.trajectory.agent if s.trajectory is not None else None
        key = ("agent", agent.session) if agent is not None else row
        index.append(ids.setdefault(key, len(ids)))
    return torch.tensor(index, dtype=torch.long)


def _images(samples: list[Sample], seq_len: int) -> dict[str, torch.Tensor]:
    """A vision-language batch's ``pixel_values [B, P, D]``, ``image_grid_thw [B, I, 3]`` (each
    row's own, zero-padded; ``MicroBatch``'s) and multimodal ``position_ids [B, S, 3]``: the
    prompt's from its processor, the response continuing from the prompt's next position on all
    three axes (as transformers' ``get_rope_index`` counts text after images); nothing when no
    sample has images."""
    prompts = [s.item.image_inputs if s.item is not None else None for s in samples]
    shown = [p for p in prompts if p is not None]
    if not shown:
        return {}
    patches = max(p.pixel_values.shape[0] for p in shown)
    pixel_values = torch.zeros((len(samples), patches, shown[0].pixel_values.shape[1]))
    grids = torch.zeros(
        (len(samples), max(len(p.image_grid_thw) for p in shown), 3), dtype=torch.long
    )
    positions = torch.zeros((len(samples), seq_len, 3), dtype=torch.long)
    for row, (s, prompt) in enumerate(zip(samples, prompts, strict=True)):
        if prompt is None:
            positions[row, : s.num_tokens] = torch.arange(s.num_tokens)[:, None]
            continue
        if len(prompt.positions) != len(s.prompt_ids):
            raise ValueError(f"row {row}: its prompt ids are not the processor's")
        positions[row, : len(s.prompt_ids)] = prompt.positions
        after = torch.arange(len(s.response_ids))[:, None] + prompt.next_position
        positions[row, len(s.prompt_ids) : s.num_tokens] = after
        pixel_values[row, : len(prompt.pixel_values)] = prompt.pixel_values
        grids[row, : len(prompt.image_grid_thw)] = prompt.image_grid_thw
    return {"pixel_values": pixel_values, "image_grid_thw": grids, "position_ids": positions}


def _engine_routing(samples: list[Sample], seq_len: int) -> torch.Tensor | None:
    """``[B, S, L, k]`` of the samples' engine routing (R3), or None without. A row's last token
    and its padding were never read by the engine: -1 there (replayed as some experts no loss
    reads: the last position scores no token; not counted as a mismatch)."""
    if not samples or any(s.routing is None for s in samples):
        return None
    layers, k = samples[0].routing.shape[1:]
    routing = torch.full((len(samples), seq_len, layers, k), -1, dtype=torch.int16)
    for row, s in enumerate(samples):
        routing[row, : s.routing.shape[0]] = s.routing
    return routing


def _teacher_log_probs(samples: list[Sample], resp_len: int) -> torch.Tensor | None:
    """``[B, R]`` of the samples' engine-teacher log-probs (0 on padding), or None without."""
    if any(s.teacher_log_probs is None for s in samples):
        return None
    values = torch.zeros((len(samples), resp_len), dtype=torch.float32)
    for row, s in enumerate(samples):
        scored = s.teacher_log_probs[: len(s.response_ids)]
        values[row, : len(scored)] = torch.tensor(scored, dtype=torch.float32)
    return values


def _teacher_top(samples: list[Sample], seq_len: int) -> dict[str, torch.Tensor]:
    """An engine teacher's top-k tokens as the batch's ``teacher_top_log_probs`` / ``scored_ids``
    ``[B, S, k]`` (each response token's at the position that predicts it, zeros elsewhere), or
    nothing without."""
    if not samples or any(s.teacher_top_ids is None for s in samples):
        return {}
    k = samples[0].teacher_top_ids.shape[1]
    log_probs = torch.zeros((len(samples), seq_len, k), dtype=torch.float32)
    ids = torch.zeros((len(samples), seq_len, k), dtype=torch.long)
    for row, s in enumerate(samples):
        first, count = len(s.prompt_ids) - 1, len(s.response_ids)
        log_probs[row, first : first + count] = s.teacher_top_log_probs[:count]
        ids[row, first : first + count] = s.teacher_top_ids[:count]
    return {"teacher_top_log_probs": log_probs, "scored_ids": ids}


def response_values(per_position: torch.Tensor, response_index: torch.Tensor) -> torch.Tensor:
    """Pick ``[B, R]`` response-aligned values out of a ``[B, S-1]`` per-position tensor
    (``[B, R, k]`` out of ``[B, S-1, k]``)."""
    index = response_index.to(per_position.device)
    if per_position.dim() == 3:
        index = index.unsqueeze(-1).expand(-1, -1, per_position.shape[-1])
    return torch.gather(per_position, 1, index)


def groups_of(samples: list[Sample]) -> list[list[Sample]]:
    """Samples grouped by prompt, in order of first appearance."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    return list(groups.values())


def balance_groups(groups: list[list[Sample]], num_parts: int) -> list[list[list[Sample]]]:
    """Split whole groups into ``num_parts`` parts with token counts as equal as possible.

    Longest-processing-time first: the largest remaining group goes to the lightest part. Parts
    differ by at most one group's tokens; the result is deterministic for the same input.
    """
    parts: list[list[list[Sample]]] = [[] for _ in range(num_parts)]
    loads = [0] * num_parts
    order = sorted(range(len(groups)), key=lambda i: (-sum(s.num_tokens for s in groups[i]), i))
    for i in order:
        lightest = min(range(num_parts), key=lambda p: (loads[p], len(parts[p]), p))
        parts[lightest].append(groups[i])
        loads[lightest] += sum(s.num_tokens for s in groups[i])
    return parts


def take_dp_share(samples: list[Sample], dp: int, dp_rank: int) -> tuple[list[Sample], int]:
    """This data-parallel rank's whole groups of the step's samples, and the fewest groups any
    DP rank holds. Every rank holds the same samples, so every rank computes the same split."""
    parts = balance_groups(groups_of(samples), dp)
    return [s for group in parts[dp_rank] for s in group], min(len(part) for part in parts)


def split_evenly(items: list[Any], num_chunks: int) -> list[list[Any]]:
    """``num_chunks`` contiguous chunks whose sizes differ by at most one (some may be empty)."""
    base, extra = divmod(len(items), num_chunks)
    chunks, start = [], 0
    for i in range(num_chunks):
        size = base + (1 if i < extra else 0)
        chunks.append(items[start : start + size])
        start += size
    return chunks
