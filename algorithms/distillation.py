"""On-policy distillation: the student samples, a frozen teacher scores each sampled token, and
the per-token reverse KL is the learning signal (Agarwal et al. 2024, "On-policy distillation of
language models"; Thinking Machines' "On-policy distillation", 2025).

The reverse KL ``KL(student || teacher)`` of a sequence is estimated on the student's own
samples, one token at a time, by ``log p_student(y_t) - log p_teacher(y_t)`` (the k1 estimator).
Its negative is the token's advantage: a token the teacher finds likelier than the student does
gets pushed up, one it finds unlikely gets pushed down. No critic, no group, no discount (each
token is graded where it stands).

An objective maps ``(student_log_probs, teacher_log_probs, mask)`` (each ``[batch, response_len]``)
to the per-token divergence ``[batch, response_len]``, zero where ``mask`` is 0, chosen by name
(``get_distill_objective("reverse_kl")``). ``distillation_advantages`` turns it into advantages,
optionally mixed with the task's own advantages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from algorithms.registry import Registry

DistillObjective = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

DISTILL_OBJECTIVES: Registry[DistillObjective] = Registry("distillation objective")
register_distill_objective = DISTILL_OBJECTIVES.register
get_distill_objective = DISTILL_OBJECTIVES.lookup


@register_distill_objective("reverse_kl")
@torch.no_grad()
def reverse_kl(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``log p_student - log p_teacher`` on the sampled tokens (k1: an unbiased estimate of the
    reverse KL on samples from the student; negative on a token the teacher prefers)."""
    return (student_log_probs - teacher_log_probs) * mask


@torch.no_grad()
def distillation_advantages(
    divergence: torch.Tensor,
    task_advantages: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    reward_weight: float,
) -> torch.Tensor:
    """``reward_weight * task_advantages - kl_coef * divergence`` on ``mask``, zero elsewhere
    (``reward_weight=0``: pure distillation, the task reward only reported)."""
    advantages = -kl_coef * divergence
    if reward_weight:
        advantages = advantages + reward_weight * task_advantages
    return advantages * mask


@torch.no_grad()
def k3_divergence(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``exp(t - s) - (t - s) - 1`` per token: a non-negative, lower-variance estimate of the same
    reverse KL (Schulman's k3), reported beside the k1 the advantage uses."""
    log_ratio = (teacher_log_probs - student_log_probs) * mask
    return (torch.exp(log_ratio) - log_ratio - 1) * mask


def response_quarters(mask: torch.Tensor) -> torch.Tensor:
    """``[batch, response_len]``: which quarter of its response's generated tokens each token is
    in (0-3, by its order among the row's tokens where ``mask`` is 1), -1 where ``mask`` is 0;
    to see where in a response the divergence sits (the first tokens, or the last)."""
    generated = mask > 0
    order = torch.cumsum(generated.long(), dim=-1) - 1
    count = generated.sum(dim=-1, keepdim=True).clamp(min=1)
    quarter = torch.div(4 * order, count, rounding_mode="floor").clamp(0, 3)
    return torch.where(generated, quarter, torch.full_like(quarter, -1))
