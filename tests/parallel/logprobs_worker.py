"""torchrun worker: vocab-parallel log-probs / entropy at TP=world size vs the full softmax.

Every rank builds the same full float64 logits, keeps its vocabulary slice, and checks values
and gradients against the unsharded computation and against central finite differences.
Exits non-zero on any mismatch; prints the measured max differences from rank 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.logprobs import (
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_and_entropy,
    vocab_parallel_top_ids,
)
from rlcli.process_lifetime import exit_skipping_teardown
from tests.parallel.test_logprobs import reference_log_probs_and_entropy


def check_against_full_softmax(padded_vocab: int, vocab_size: int) -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(padded_vocab)
    full = 4 * torch.randn(3, 6, padded_vocab, dtype=torch.float64, generator=generator)
    labels = torch.randint(0, vocab_size, (3, 6), generator=generator)
    upstream_lp = torch.randn(3, 6, dtype=torch.float64, generator=generator)
    upstream_h = torch.randn(3, 6, dtype=torch.float64, generator=generator)
    width = padded_vocab // world
    shard = full[..., rank * width : (rank + 1) * width].clone().requires_grad_()

    log_probs, entropy = vocab_parallel_log_probs_and_entropy(
        shard, labels, dist.group.WORLD, vocab_size
    )
    (log_probs * upstream_lp + entropy * upstream_h).sum().backward()

    ref_full = full.clone().requires_grad_()
    ref_lp, ref_h = reference_log_probs_and_entropy(ref_full, labels, vocab_size)
    (ref_lp * upstream_lp + ref_h * upstream_h).sum().backward()
    ref_grad = ref_full.grad[..., rank * width : (rank + 1) * width]

    diffs = {
        "log_probs": (log_probs - ref_lp).abs().max().item(),
        "entropy": (entropy - ref_h).abs().max().item(),
        "grad": (shard.grad - ref_grad).abs().max().item(),
    }
    assert all(d < 1e-12 for d in diffs.values()), (padded_vocab, vocab_size, rank, diffs)
    return diffs


def check_finite_differences(vocab_size: int, eps: float = 1e-6) -> float:
    """Central differences of a scalar objective w.r.t. every element of the FULL logits.

    torch's gradcheck cannot be used across ranks (both ranks would perturb at once), so the
    owning rank perturbs one element at a time while the others keep theirs fixed.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(7)
    full = torch.randn(2, 3, 4 * world, dtype=torch.float64, generator=generator)
    labels = torch.randint(0, vocab_size, (2, 3), generator=generator)
    upstream_lp = torch.randn(2, 3, dtype=torch.float64, generator=generator)
    upstream_h = torch.randn(2, 3, dtype=torch.float64, generator=generator)
    shard = full[..., rank * 4 : (rank + 1) * 4].clone()

    def objective(x: torch.Tensor) -> torch.Tensor:
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(
            x, labels, dist.group.WORLD, vocab_size
        )
        return (log_probs * upstream_lp + entropy * upstream_h).sum()

    analytic_input = shard.clone().requires_grad_()
    objective(analytic_input).backward()
    analytic = torch.zeros_like(full)
    analytic[..., rank * 4 : (rank + 1) * 4] = analytic_input.grad
    dist.all_reduce(analytic)

    numeric = torch.zeros_like(full)
    for index in range(full.numel()):
        row, column = divmod(index, full.size(-1))
        values = []
        for sign in (1, -1):
            perturbed = shard.clone()
            if column // 4 == rank:
                perturbed.view(-1, 4)[row, column % 4] += sign * eps
            values.append(objective(perturbed).item())
        numeric.view(-1)[index] = (values[0] - values[1]) / (2 * eps)
    max_diff = (numeric - analytic).abs().max().item()
    assert max_diff < 1e-6, max_diff
    assert torch.all(analytic[..., vocab_size:] == 0)
    return max_diff


def check_top_k_and_several_labels(padded_vocab: int, vocab_size: int, k: int) -> float:
    """The top ``k`` ids over the shards equal torch's top ``k`` of the full log-softmax (``k``
    larger than a shard's slice too), and as ``[b, s, k]`` labels they give its log-probs and the
    full gradient's slice."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(11 + k)
    full = 4 * torch.randn(2, 5, padded_vocab, dtype=torch.float64, generator=generator)
    upstream = torch.randn(2, 5, k, dtype=torch.float64, generator=generator)
    width = padded_vocab // world
    shard = full[..., rank * width : (rank + 1) * width].clone().requires_grad_()
    ids = vocab_parallel_top_ids(shard, k, dist.group.WORLD, vocab_size)
    ref_full = full.clone().requires_grad_()
    ref_log_p = torch.log_softmax(ref_full[..., :vocab_size], dim=-1)
    ref_top, ref_ids = ref_log_p.topk(k, dim=-1)
    assert torch.equal(ids, ref_ids), (rank, ids, ref_ids)
    picked = vocab_parallel_log_probs(shard, ids, dist.group.WORLD, vocab_size)
    (picked * upstream).sum().backward()
    (ref_top * upstream).sum().backward()
    ref_grad = ref_full.grad[..., rank * width : (rank + 1) * width]
    diff = max(
        (picked - ref_top).abs().max().item(),
        (shard.grad - ref_grad).abs().max().item(),
    )
    assert diff < 1e-12, (rank, k, diff)
    return diff


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    results = {}
    # No padding; padding inside the last slice only; a last slice made entirely of padding.
    for vocab_size in (8 * world, 8 * world - 3, 8 * world - 8):
        results[vocab_size] = check_against_full_softmax(8 * world, vocab_size)
    fd_diff = check_finite_differences(vocab_size=4 * world - 1)
    top_diffs = [check_top_k_and_several_labels(8 * world, 8 * world - 3, k) for k in (3, 11)]
    if dist.get_rank() == 0:
        for key, diffs in results.items():
            print(f"LOGPROBS_DIFFS tp={world} vocab_size={key}/{8 * world}: {diffs}", flush=True)
        print(f"LOGPROBS_FINITE_DIFF tp={world}: {fd_diff:.2e}", flush=True)
        print(f"LOGPROBS_TOP_K tp={world}: {max(top_diffs):.2e}", flush=True)
        print("LOGPROBS_WORKER_OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
