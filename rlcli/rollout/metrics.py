"""Trainer-vs-engine agreement on the sampled tokens, logged every step."""

from __future__ import annotations

import torch


def logprob_mismatch(
    engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Mean and max |engine - trainer| log-prob over response tokens.

    engine_logprobs, trainer_logprobs: [batch, response_len]; response_mask: [batch,
    response_len], 1 on real response tokens. An empty mask gives 0.0 for both.
    """
    mask = response_mask.bool()
    diff = (engine_logprobs.double() - trainer_logprobs.double()).abs()[mask]
    if diff.numel() == 0:
        return {"rollout/logprob_diff_mean": 0.0, "rollout/logprob_diff_max": 0.0}
    return {
        "rollout/logprob_diff_mean": diff.mean().item(),
        "rollout/logprob_diff_max": diff.max().item(),
    }
