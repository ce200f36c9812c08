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

A top-k loss (``get_top_k_loss("topk_forward_kl")``) grades the whole next-token distribution
instead of the one sampled token: at every generated position the teacher's ``k`` likeliest
tokens, and the student's log-probs of those same tokens (``[batch, response_len, k]`` each,
normalised over the whole vocabulary), give a per-token loss that is differentiated through the
student directly (it is added to the policy loss, not turned into an advantage). It names the
token the teacher would have chosen, which a sampled-token estimate cannot when the student drew
another one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from algorithms.registry import Registry

DistillObjective = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

DISTILL_OBJECTIVES: Registry[DistillObjective] = Registry("distillation objective")
register_distill_objective = DISTILL_OBJECTIVES.register
get_distill_objective = DISTILL_OBJECTIVES.lookup

# (student_top_log_probs, teacher_top_log_probs, mask) -> per-token loss [batch, response_len]
TopKLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

TOP_K_LOSSES: Registry[TopKLoss] = Registry("top-k distillation loss")
register_top_k_loss = TOP_K_LOSSES.register
get_top_k_loss = TOP_K_LOSSES.lookup


def distill_objective_names() -> list[str]:
    """Every name ``distill.objective`` accepts: a sampled-token objective or a top-k loss."""
    return sorted([*DISTILL_OBJECTIVES, *TOP_K_LOSSES])


@register_distill_objective("reverse_kl")
@torch.no_grad()
def reverse_kl(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``log p_student - log p_teacher`` on the sampled tokens (k1: an unbiased estimate of the
    reverse KL on samples from the student; negative on a token the teacher prefers)."""
    return (student_log_probs - teacher_log_probs) * mask


@register_top_k_loss("topk_forward_kl")
def topk_forward_kl(
    student_top_log_probs: torch.Tensor, teacher_top_log_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``KL(teacher || student)`` between the two distributions over ``k + 1`` outcomes: each
    of the teacher's top ``k`` tokens ``v_j`` of the position, and "any other token" (the
    rest of the vocabulary, mass ``1 - sum_j p(v_j)`` under either model). Inputs are
    ``[..., k]`` log-probs over the whole vocabulary. A true divergence of the two coarsened
    distributions: zero, with a zero gradient, exactly when the student gives each ``v_j`` and
    the rest the teacher's mass; never above the full forward KL, and equal to it when ``k``
    covers the vocabulary. The rest's outcome is what pulls the student's mass off the tokens
    the teacher finds unlikely."""
    teacher_probs = teacher_top_log_probs.exp()
    per_token = (teacher_probs * (teacher_top_log_probs - student_top_log_probs)).sum(dim=-1)
    teacher_rest = (1 - teacher_probs.sum(dim=-1)).clamp(min=0)
    per_token = per_token + teacher_rest * (
        _log_rest(teacher_top_log_probs) - _log_rest(student_top_log_probs)
    )
    return per_token * mask


def _log_rest(top_log_probs: torch.Tensor) -> torch.Tensor:
    """``log(1 - sum_j p_j)`` of ``[..., k]`` log-probs, accurately near 0 and 1 (``expm1``);
    floored where the top ``k`` hold all the mass (the term is then weighted by zero)."""
    covered = torch.logsumexp(top_log_probs, dim=-1).clamp(max=0)
    return torch.log((-torch.expm1(covered)).clamp(min=1e-30))


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
