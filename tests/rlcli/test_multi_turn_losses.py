"""The actor's loss on multi-turn batches: tool tokens (loss mask 0) inside a response take no
part in the policy loss, the KL loss, the entropy bonus or the denominators, under every
``loss_agg_mode``. Checked against a hand computation on the generated tokens alone, with
large garbage values on the tool tokens, so any leak shows."""

from __future__ import annotations

import math

import pytest
import torch

import algorithms
from parallel.step_types import ModelOutputs
from rlcli.config.schema import RLConfig
from rlcli.rollout.batch import Sample, collate
from rlcli.train.actor_update import make_actor_loss

# Per row: its response's loss mask (1 generated, 0 appended by a tool), as a 3-turn trajectory,
# a 2-turn one, and a single-turn answer.
MASKS = [
    [1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1],
    [1, 1, 0, 0, 0, 1, 1, 1],
    [1, 1, 1, 1],
]
PROMPTS = [3, 5, 4]
NORM_LENGTH = 16
ENTROPY_COEFF, KL_COEF = 0.01, 0.3


def _batch():
    samples = [
        Sample(
            group=row,
            prompt_ids=list(range(1, prompt + 1)),
            response_ids=[7] * len(mask),
            engine_log_probs=[-0.5 if m else 0.0 for m in mask],
            finish_reason="stop",
            item=None,
            loss_mask=list(mask),
        )
        for row, (prompt, mask) in enumerate(zip(PROMPTS, MASKS, strict=True))
    ]
    batch = collate(samples, pad_id=0)
    gen = torch.Generator().manual_seed(0)
    shape = batch.loss_mask.shape
    garbage = (1 - batch.loss_mask) * 1e4  # on tool tokens and padding
    batch.old_log_probs = -torch.rand(shape, generator=gen) - 0.1 + garbage
    batch.ref_log_probs = -torch.rand(shape, generator=gen) - 0.1 - garbage
    batch.advantages = torch.randn(shape, generator=gen) + garbage
    positions = batch.input_ids.shape[1] - 1
    outputs = {
        "log_probs": -torch.rand(batch.size, positions, generator=gen) - 0.1,
        "entropy": torch.rand(batch.size, positions, generator=gen) * 2,
    }
    # Garbage where the trainer's per-position outputs score tool tokens.
    rows, columns = (batch.response_mask - batch.loss_mask).nonzero(as_tuple=True)
    assert len(rows) == sum(len(m) - sum(m) for m in MASKS)
    for name, value in (("log_probs", 50.0), ("entropy", 1e4)):
        outputs[name][rows, batch.response_index[rows, columns]] = value
    return batch, outputs


def _generated(values: torch.Tensor, batch, row: int) -> list[float]:
    return values[row][batch.loss_mask[row].bool()].tolist()


def _hand_ppo(log_prob: float, old: float, advantage: float) -> float:
    ratio = math.exp(log_prob - old)
    loss = max(-advantage * ratio, -advantage * min(max(ratio, 0.8), 1.2))
    return min(loss, -advantage * 3.0) if advantage < 0 else loss


def _hand_aggregate(rows: list[list[float]], mode: str) -> float:
    if mode == "token-mean":
        return sum(map(sum, rows)) / sum(map(len, rows))
    if mode == "seq-mean-token-sum":
        return sum(map(sum, rows)) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(map(sum, rows)) / (len(rows) * NORM_LENGTH)  # seq-mean-token-sum-norm


@pytest.mark.parametrize("mode", algorithms.LOSS_AGG_MODES)
def test_masked_losses_equal_a_hand_computation_on_generated_tokens(mode):
    cfg = RLConfig()
    cfg.actor.loss_agg_mode = mode
    cfg.actor.entropy_coeff = ENTROPY_COEFF
    cfg.actor.use_kl_loss = True
    cfg.actor.kl_loss_coef = KL_COEF
    batch, outputs = _batch()
    denominator = algorithms.agg_loss_denominator(batch.loss_mask, mode, norm_length=NORM_LENGTH)
    loss, report = make_actor_loss(cfg, denominator)(ModelOutputs(**outputs), batch)
    metrics = report.metrics

    log_prob = torch.gather(outputs["log_probs"], 1, batch.response_index)
    entropy = torch.gather(outputs["entropy"], 1, batch.response_index)
    pg, kl, ent = [], [], []
    for row in range(batch.size):
        lp = _generated(log_prob, batch, row)
        old = _generated(batch.old_log_probs, batch, row)
        ref = _generated(batch.ref_log_probs, batch, row)
        adv = _generated(batch.advantages, batch, row)
        assert len(lp) == sum(MASKS[row])
        pg.append([_hand_ppo(a, b, c) for a, b, c in zip(lp, old, adv, strict=True)])
        kl.append([math.exp(r - a) - (r - a) - 1 for a, r in zip(lp, ref, strict=True)])
        ent.append(_generated(entropy, batch, row))
    expected_pg = _hand_aggregate(pg, mode)
    expected_kl = _hand_aggregate(kl, mode)
    expected_entropy = _hand_aggregate(ent, mode)
    assert metrics["actor/pg_loss"] == pytest.approx(expected_pg, rel=1e-5)
    assert metrics["actor/kl_loss"] == pytest.approx(expected_kl, rel=1e-5)
    assert metrics["actor/entropy"] == pytest.approx(expected_entropy, rel=1e-5)
    expected = expected_pg - ENTROPY_COEFF * expected_entropy + KL_COEF * expected_kl
    assert loss.item() == pytest.approx(expected, rel=1e-5)
