"""On-policy distillation's per-token signal (``algorithms.distillation``) against a hand
computation on two responses, the second one token shorter (its last column is padding):

  row 0: p_student = (0.5, 0.2, 0.4), p_teacher = (0.25, 0.4, 0.4)
         k1 = log(0.5/0.25), log(0.2/0.4), 0 = (ln 2, -ln 2, 0)
  row 1: p_student = (0.1, 0.8, -),   p_teacher = (0.8, 0.8, -)
         k1 = (ln 0.125, 0) = (-3 ln 2, 0)

The advantage is -kl_coef * k1 plus reward_weight times the task's advantage.
"""

from __future__ import annotations

import math

import pytest
import torch

import algorithms

STUDENT = torch.tensor([[0.5, 0.2, 0.4], [0.1, 0.8, 0.3]]).log()
TEACHER = torch.tensor([[0.25, 0.4, 0.4], [0.8, 0.8, 0.9]]).log()
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
LN2 = math.log(2)
K1 = [[LN2, -LN2, 0.0], [-3 * LN2, 0.0, 0.0]]


def close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), atol=1e-6, rtol=0)


def test_reverse_kl_is_the_log_ratio_on_the_sampled_tokens():
    divergence = algorithms.get_distill_objective("reverse_kl")(STUDENT, TEACHER, MASK)
    close(divergence, K1)


def test_advantage_pushes_up_what_the_teacher_prefers_and_mixes_the_task_in():
    divergence = torch.tensor(K1)
    task = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 5.0]])  # padding carries garbage
    pure = algorithms.distillation_advantages(divergence, task, MASK, kl_coef=2.0, reward_weight=0)
    close(pure, [[-2 * LN2, 2 * LN2, 0.0], [6 * LN2, 0.0, 0.0]])
    mixed = algorithms.distillation_advantages(
        divergence, task, MASK, kl_coef=1.0, reward_weight=0.5
    )
    close(mixed, [[0.5 - LN2, 0.5 + LN2, 0.5], [-0.5 + 3 * LN2, -0.5, 0.0]])


def test_k3_is_non_negative_and_zero_only_where_the_two_agree():
    k3 = algorithms.k3_divergence(STUDENT, TEACHER, MASK)
    # exp(t - s) - (t - s) - 1 with t - s = (-ln 2, ln 2, 0 | 3 ln 2, 0)
    expected = [
        [0.5 + LN2 - 1, 2 - LN2 - 1, 0.0],
        [8 - 3 * LN2 - 1, 0.0, 0.0],
    ]
    close(k3, expected)


def test_a_teacher_equal_to_the_student_gives_no_signal():
    divergence = algorithms.get_distill_objective("reverse_kl")(STUDENT, STUDENT.clone(), MASK)
    advantages = algorithms.distillation_advantages(
        divergence, torch.zeros_like(MASK), MASK, kl_coef=1.0, reward_weight=0
    )
    assert torch.count_nonzero(advantages) == 0


def test_an_unknown_objective_names_the_valid_ones():
    with pytest.raises(ValueError, match="reverse_kl"):
        algorithms.get_distill_objective("forward_kl")


def test_response_quarters_split_each_rows_generated_tokens_in_order():
    # 8 generated tokens: two per quarter; 3 tokens with a tool token between (0 in the mask):
    # orders 0, 1, 2 of 3 -> quarters 0, 1, 2; padding -1.
    mask = torch.tensor(
        [[1.0, 1, 1, 1, 1, 1, 1, 1], [1.0, 0, 1, 1, 0, 0, 0, 0], [0.0, 0, 0, 0, 0, 0, 0, 0]]
    )
    assert algorithms.response_quarters(mask).tolist() == [
        [0, 0, 1, 1, 2, 2, 3, 3],
        [0, -1, 1, 2, -1, -1, -1, -1],
        [-1, -1, -1, -1, -1, -1, -1, -1],
    ]


def test_topk_forward_kl_by_hand():
    """Teacher top-2 (0.5, 0.25), the rest 0.25.
    Student (0.25, 0.5), rest 0.25: 0.5 ln(0.5/0.25) + 0.25 ln(0.25/0.5) + 0 = 0.25 ln 2.
    Student (0.5, 0.4), rest 0.1: 0 + 0.25 ln(0.25/0.4) + 0.25 ln(0.25/0.1) = 0.5 ln 1.25.
    The teacher itself: 0; a masked position: 0."""
    teacher = torch.tensor([[[0.5, 0.25]] * 4]).log()
    student = torch.tensor([[[0.25, 0.5], [0.5, 0.4], [0.5, 0.25], [0.1, 0.1]]]).log()
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss = algorithms.get_top_k_loss("topk_forward_kl")(student, teacher, mask)
    close(loss, [[0.25 * LN2, 0.5 * math.log(1.25), 0.0, 0.0]])


def coarse_forward_kl(student_logits, teacher_logits, ids):
    """The same divergence written in probabilities: the k tokens and "the rest" as k + 1
    outcomes of each model, then sum p (log p - log q)."""

    def coarse(logits):
        probs = torch.softmax(logits, dim=-1)
        top = probs[ids]
        return torch.cat([top, (1 - top.sum()).reshape(1)])

    p, q = coarse(teacher_logits), coarse(student_logits)
    return (p * (p.log() - q.log())).sum()


@pytest.mark.parametrize("k", [1, 3, 6])
def test_topk_forward_kl_matches_the_coarse_distributions_and_vanishes_at_the_teacher(k):
    """Value and gradient in the student's logits over a 6-token vocabulary against the
    probability-space formula; at the teacher's own logits both are zero; with k = 6 (the whole
    vocabulary) it is the full forward KL."""
    torch.manual_seed(k)
    teacher_logits = torch.randn(6, dtype=torch.float64)
    teacher_top, ids = torch.log_softmax(teacher_logits, dim=-1).topk(k)
    loss_fn = algorithms.get_top_k_loss("topk_forward_kl")
    one = torch.ones(1, 1, dtype=torch.float64)

    def ours(logits):
        student_top = torch.log_softmax(logits, dim=-1)[ids]
        return loss_fn(student_top[None, None], teacher_top[None, None], one).sum()

    logits = torch.randn(6, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(ours(logits), logits)
    reference = logits.detach().clone().requires_grad_()
    if k == 6:  # the rest is empty: the full forward KL
        full = torch.log_softmax(teacher_logits, -1)
        expected = (full.exp() * (full - torch.log_softmax(reference, -1))).sum()
    else:
        expected = coarse_forward_kl(reference, teacher_logits, ids)
    (expected_grad,) = torch.autograd.grad(expected, reference)
    torch.testing.assert_close(ours(logits), expected.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)
    at_teacher = teacher_logits.clone().requires_grad_()
    value = ours(at_teacher)
    (grad_at_teacher,) = torch.autograd.grad(value, at_teacher)
    assert abs(value.item()) < 1e-12 and grad_at_teacher.abs().max().item() < 1e-12


def test_objective_names_cover_both_kinds():
    assert algorithms.distill_objective_names() == ["reverse_kl", "topk_forward_kl"]
    with pytest.raises(ValueError, match="topk_forward_kl"):
        algorithms.get_top_k_loss("topk_reverse")
