"""The step's token-level scores (rlcli.train.advantages): DAPO's overlong shaping measures what the
policy generated against the run's response budget."""

from __future__ import annotations

import pytest

from rlcli.config.schema import RLConfig
from rlcli.rollout.batch import Sample, collate
from rlcli.train.advantages import token_level_scores


def _sample(generated: int, appended: int = 0, turns: int = 1) -> Sample:
    """A response of ``generated`` model tokens, with ``appended`` tool tokens (loss mask 0)
    after each of the first ``turns - 1`` turns (multi-turn), or a single-turn answer."""
    if turns == 1 and not appended:
        return Sample(0, [1, 2], [5] * generated, [0.0] * generated, "stop", None, score=1.0)
    per_turn = generated // turns
    mask: list[int] = []
    for turn in range(turns):
        mask += [1] * per_turn
        if turn < turns - 1:
            mask += [0] * appended
    ids = [5] * len(mask)
    return Sample(0, [1, 2], ids, [0.0] * len(ids), "stop", None, score=1.0, loss_mask=mask)


def _config(multi_turn: bool) -> RLConfig:
    cfg = RLConfig()
    cfg.rollout.max_tokens = 16  # per assistant turn with multi-turn rollouts
    cfg.rollout.multi_turn.enable = multi_turn
    cfg.rollout.multi_turn.max_response_tokens = 256
    cfg.algorithm.overlong.enabled = True
    cfg.algorithm.overlong.buffer_len = 8
    return cfg


def _final_score(sample: Sample, cfg: RLConfig) -> float:
    return token_level_scores(collate([sample], pad_id=0), cfg).sum().item()


def test_overlong_single_turn_counts_the_answer_against_rollout_max_tokens():
    cfg = _config(multi_turn=False)
    assert _final_score(_sample(8), cfg) == 1.0  # up to max_tokens - buffer_len: no penalty
    assert _final_score(_sample(12), cfg) == pytest.approx(1.0 - 4 / 8)
    assert _final_score(_sample(16), cfg) == pytest.approx(0.0)  # -penalty_factor at the max


def test_overlong_multi_turn_counts_generated_tokens_against_the_trajectory_budget():
    """Three turns of 10 generated tokens with 40 tool tokens after each of the first two: 110
    response tokens, 30 generated. Measured as the whole response against rollout.max_tokens
    (a per-turn budget) it would be far "overlong"; the policy wrote 30 of a 256-token budget."""
    cfg = _config(multi_turn=True)
    assert _final_score(_sample(30, appended=40, turns=3), cfg) == 1.0
    # Generated tokens near the trajectory's budget (rollout.multi_turn.max_response_tokens)
    # are penalised as a single-turn answer near rollout.max_tokens is.
    assert _final_score(_sample(252, appended=2, turns=2), cfg) == pytest.approx(1.0 - 4 / 8)


def test_an_overlong_buffer_beyond_the_response_budget_is_refused_at_config_time():
    from rlcli.errors import UserError
    from rlcli.validation.loader import load_config

    overlong = ["model.path=m", "algorithm.overlong.enabled=true", "rollout.max_tokens=32"]
    with pytest.raises(UserError, match=r"buffer_len=64 must be in \(0, rollout.max_tokens=32\]"):
        load_config(None, [*overlong, "algorithm.overlong.buffer_len=64"])
    load_config(None, [*overlong, "algorithm.overlong.buffer_len=32"])


def _agent_sample(group: int, session: str, score: float, segment: int, segments: int) -> Sample:
    from rlcli.rollout.trajectory import AgentRecord, TrajectoryRecord

    record = TrajectoryRecord([], "", 1, agent=AgentRecord(session, None, segment, segments))
    return Sample(group, [1, 2], [5, 6, 7], [0.0] * 3, "stop", None, score, trajectory=record)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_split_agent_trajectory_counts_once_in_its_group(estimator):
    """Group 0: trajectory A split into two segments (score 1 on each), B and C (score 0).
    Worked by hand over the three trajectories, scores [1, 0, 0]: GRPO's mean 1/3, unbiased std
    sqrt(1/3), so A gets (2/3) / sqrt(1/3) and B, C get -(1/3) / sqrt(1/3); RLOO's leave-one-out
    baselines give A 1 - 0 = 1, B and C 0 - 1/2. Counting A's segments as two samples would
    give GRPO +-0.866 and RLOO 1 - 1/3 for A instead."""
    import algorithms
    from rlcli.train.advantages import compute_advantages

    cfg = RLConfig()
    cfg.algorithm.adv_estimator = estimator
    samples = [
        _agent_sample(0, "a", 1.0, 0, 2),
        _agent_sample(0, "a", 1.0, 1, 2),
        _agent_sample(0, "b", 0.0, 0, 1),
        _agent_sample(0, "c", 0.0, 0, 1),
    ]
    batch = collate(samples, pad_id=0)
    assert batch.trajectory_index.tolist() == [0, 0, 1, 2]

    class NoDataParallel:
        def sum(self, tensor):
            return tensor

        def max(self, tensor):
            return tensor

    compute_advantages(batch, cfg, algorithms.FixedKLController(0.0), NoDataParallel())
    per_row = (batch.advantages.sum(-1) / batch.loss_mask.sum(-1)).tolist()
    if estimator == "grpo":
        a, b = (2 / 3) / (1 / 3) ** 0.5, -(1 / 3) / (1 / 3) ** 0.5
    else:
        a, b = 1.0, -0.5
    assert per_row == pytest.approx([a, a, b, b], abs=1e-5)
    assert (batch.advantages == batch.advantages[:, :1] * batch.loss_mask).all()  # per token
