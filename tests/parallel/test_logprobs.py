"""Vocab-parallel log-probs and entropy against the unsharded torch computation."""

from __future__ import annotations

import pytest
import torch

from parallel.logprobs import (
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_and_entropy,
    vocab_parallel_top_ids,
)


def vocab_parallel_entropy(logits, tp_group=None, vocab_size=None) -> torch.Tensor:
    """The entropy alone (no labels: the log-probabilities are skipped)."""
    return vocab_parallel_log_probs_and_entropy(logits, None, tp_group, vocab_size)[1]


def reference_log_probs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain full-vocabulary computation over the first `vocab_size` columns."""
    log_p = torch.log_softmax(logits[..., :vocab_size].double(), dim=-1)
    picked = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return picked, entropy


@pytest.mark.parametrize("vocab_size", [13, 16])
def test_values_and_gradients_match_full_softmax(vocab_size: int) -> None:
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 7, 16, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, vocab_size, (3, 7))
    upstream_lp = torch.randn(3, 7, dtype=torch.float64)
    upstream_h = torch.randn(3, 7, dtype=torch.float64)

    log_probs, entropy = vocab_parallel_log_probs_and_entropy(logits, labels, None, vocab_size)
    grad = torch.autograd.grad((log_probs * upstream_lp + entropy * upstream_h).sum(), logits)[0]

    ref_logits = logits.detach().clone().requires_grad_()
    ref_lp, ref_h = reference_log_probs_and_entropy(ref_logits, labels, vocab_size)
    ref_grad = torch.autograd.grad((ref_lp * upstream_lp + ref_h * upstream_h).sum(), ref_logits)[0]

    torch.testing.assert_close(log_probs, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, ref_h, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)
    assert torch.all(grad[..., vocab_size:] == 0), "padded columns must get no gradient"


def test_gradcheck_float64_with_padding() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 9, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 7, (2, 3))
    assert torch.autograd.gradcheck(lambda x: vocab_parallel_log_probs(x, labels, None, 7), logits)
    assert torch.autograd.gradcheck(lambda x: vocab_parallel_entropy(x, None, 7), logits)
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_log_probs_and_entropy(x, labels, None, 7), logits
    )


def test_single_shard_log_probs_equal_the_reducing_function() -> None:
    """Unsharded and unpadded, the log-probs take torch's fused log-softmax with an in-place
    backward; values and gradients equal the reducing autograd function's (which the entropy and
    every sharded case use) and autograd's through plain torch ops."""
    torch.manual_seed(3)
    logits = (3 * torch.randn(3, 7, 16, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, 16, (3, 7))
    upstream = torch.randn(3, 7, dtype=torch.float64)
    fast = vocab_parallel_log_probs(logits, labels, None, 16)
    (fast_grad,) = torch.autograd.grad((fast * upstream).sum(), logits)
    reduced, _ = vocab_parallel_log_probs_and_entropy(logits, labels, None, 16)
    (reduced_grad,) = torch.autograd.grad((reduced * upstream).sum(), logits)
    plain, _ = reference_log_probs_and_entropy(logits, labels, 16)
    (plain_grad,) = torch.autograd.grad((plain * upstream).sum(), logits)
    torch.testing.assert_close(fast, reduced, rtol=0, atol=1e-12)
    torch.testing.assert_close(fast_grad, reduced_grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(fast_grad, plain_grad, rtol=0, atol=1e-12)


def test_single_shard_backward_consumes_its_buffer_loudly() -> None:
    """The fast path's backward turns the saved log-softmax into the gradient in place: a second
    backward through the same graph must raise, never read the consumed buffer."""
    logits = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    log_probs = vocab_parallel_log_probs(logits, torch.randint(0, 8, (2, 3)))
    log_probs.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        log_probs.sum().backward()


def test_low_precision_logits_reduce_in_float32_and_leave_input_untouched() -> None:
    torch.manual_seed(2)
    logits = (20 * torch.randn(4, 5, 32)).to(torch.bfloat16).requires_grad_()
    before = logits.detach().clone()
    labels = torch.randint(0, 32, (4, 5))
    log_probs = vocab_parallel_log_probs(logits, labels)
    entropy = vocab_parallel_entropy(logits)
    (log_probs.sum() + entropy.sum()).backward()

    ref_lp, ref_h = reference_log_probs_and_entropy(before.float(), labels, 32)
    assert log_probs.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(log_probs.double(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_h, rtol=0, atol=1e-5)
    assert torch.equal(logits.detach(), before)


@pytest.mark.parametrize("vocab_size", [13, 16])
def test_several_labels_per_position_match_full_softmax(vocab_size: int) -> None:
    """``[b, s, k]`` labels (on-policy distillation's teacher top-k ids, duplicates included):
    the log-probs of each and the gradient of any weighting of them, on both the fused
    single-shard path (vocab 16: unpadded) and the reducing one (13 of 16 columns)."""
    torch.manual_seed(4)
    logits = (3 * torch.randn(3, 7, 16, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, vocab_size, (3, 7, 4))
    labels[0, 0, 1] = labels[0, 0, 0]  # the same id twice: its gradient counts twice
    upstream = torch.randn(3, 7, 4, dtype=torch.float64)
    several = vocab_parallel_log_probs(logits, labels, None, vocab_size)
    (grad,) = torch.autograd.grad((several * upstream).sum(), logits)
    with_entropy, _ = vocab_parallel_log_probs_and_entropy(logits, labels, None, vocab_size)
    (grad_with_entropy,) = torch.autograd.grad((with_entropy * upstream).sum(), logits)

    log_p = torch.log_softmax(logits[..., :vocab_size], dim=-1)
    plain = log_p.gather(-1, labels)
    (plain_grad,) = torch.autograd.grad((plain * upstream).sum(), logits)
    assert several.shape == (3, 7, 4)
    torch.testing.assert_close(several, plain, rtol=0, atol=1e-12)
    torch.testing.assert_close(with_entropy, plain, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, plain_grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_with_entropy, plain_grad, rtol=0, atol=1e-12)


def test_top_log_probs_are_torch_topk_of_the_log_softmax() -> None:
    torch.manual_seed(5)
    logits = 3 * torch.randn(2, 5, 16, dtype=torch.float64)
    ids = vocab_parallel_top_ids(logits, 4, None, 13)
    log_probs = vocab_parallel_log_probs(logits, ids, None, 13)
    expected, expected_ids = torch.log_softmax(logits[..., :13], dim=-1).topk(4, dim=-1)
    torch.testing.assert_close(log_probs, expected, rtol=0, atol=1e-12)
    assert torch.equal(ids, expected_ids) and bool((ids < 13).all())


@pytest.mark.dist
def test_tp2_values_and_gradients_match_unsharded() -> None:
    from tests.parallel.dist_utils import REPO_ROOT, run_torchrun

    output = run_torchrun(REPO_ROOT / "tests/parallel/logprobs_worker.py", 2, timeout_s=300)
    assert "LOGPROBS_WORKER_OK" in output, output[-3000:]
