"""Log-probabilities and entropy from vocabulary-parallel logits.

Under tensor parallelism Megatron's output layer leaves each TP rank with a slice
``[..., V/tp]`` of the logits. The functions here reduce across the slices with three
all-reduces of ``[...]``-shaped tensors (max, sum of exponentials, label logit; one more
for the entropy), so no rank ever holds the full vocabulary. Forward and backward are one
``torch.autograd.Function`` with a hand-written backward that needs no communication. When the
logits are neither split nor padded (TP 1), the log-probs alone take torch's fused log-softmax
with a backward that reuses its output's buffer (``_LabelLogProbs``).

Why not megatron-core's ``tensor_parallel.vocab_parallel_cross_entropy``: it has no way
to exclude padded vocabulary columns, always uses the global TP group, computes in
float32 even for float64 input (so no float64 gradcheck), and subtracts the max from
float32 logits *in place*, corrupting the caller's tensor when the same logits are also
used for the entropy.

Padded columns: the vocabulary is padded so every TP rank holds an equal slice
(``parallel.model.padded_vocab_size``); the columns with a global index ``>= vocab_size``
are not tokens and are masked to ``-inf``, so they carry no probability mass and receive no
gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """``log softmax(logits)[label]`` over the full (sharded) vocabulary.

    Args:
        logits: ``[b, s, V/tp]`` this rank's vocabulary slice (rank r holds global columns
            ``r*V/tp .. (r+1)*V/tp - 1``); any leading shape works.
        labels: ``[b, s]`` global token ids, each ``< vocab_size``; or ``[b, s, k]``: ``k`` ids
            per position, whose log-probs come back as ``[b, s, k]`` (one softmax for all).
        tp_group: the tensor-parallel group the vocabulary is split over; ``None`` means the
            logits are not split.
        vocab_size: the unpadded vocabulary size; columns at or beyond it are excluded.
            ``None`` means no padding.

    Returns:
        ``[b, s]`` (``[b, s, k]``) log-probabilities in float32 (float64 for float64 logits),
        identical on every rank of ``tp_group``.
    """
    if _single_shard(logits, tp_group, vocab_size):
        # Nothing to reduce across ranks and no padded column: torch's fused log-softmax is
        # about twice as fast as the reductions below.
        return _LabelLogProbs.apply(logits, labels)
    log_probs, _ = _LogProbsAndEntropy.apply(logits, labels, tp_group, vocab_size, False)
    return log_probs


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Both at once, sharing the max / normaliser reductions: ``([b, s] or None, [b, s])``.

    ``labels=None`` skips the log-probabilities (the first result is then ``None``); ``[b, s, k]``
    labels give ``[b, s, k]`` log-probs (``vocab_parallel_log_probs``).
    """
    if labels is None:
        labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
        _, entropy = _LogProbsAndEntropy.apply(logits, labels, tp_group, vocab_size, True)
        return None, entropy
    return _LogProbsAndEntropy.apply(logits, labels, tp_group, vocab_size, True)


@torch.no_grad()
def vocab_parallel_top_ids(
    logits: torch.Tensor,
    k: int,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """The ids ``[..., k]`` (int64) of every position's ``k`` likeliest tokens over the full
    (sharded) vocabulary, likeliest first, identical on every rank of ``tp_group``; their
    log-probs are ``vocab_parallel_log_probs(logits, ids)``'s. Each shard's own top ``k`` holds
    every global top-``k`` token of its slice, so an all-gather of ``tp * k`` candidates per
    position and one more top-``k`` over them is exact; padded columns never win."""
    start, padded = _shard_layout(logits, tp_group, vocab_size)
    z = _masked_logits(logits, _compute_dtype(logits), padded)
    values, ids = z.topk(min(k, z.size(-1)), dim=-1)
    ids = ids + start
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        world = dist.get_world_size(tp_group)
        all_values = [torch.empty_like(values) for _ in range(world)]
        all_ids = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(all_values, values.contiguous(), group=tp_group)
        dist.all_gather(all_ids, ids.contiguous(), group=tp_group)
        _, which = torch.cat(all_values, dim=-1).topk(k, dim=-1)
        ids = torch.cat(all_ids, dim=-1).gather(-1, which)
    return ids


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    # bf16/fp16 logits are reduced in float32: a 150k-term softmax sum in bf16 is useless.
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _single_shard(
    logits: torch.Tensor, tp_group: dist.ProcessGroup | None, vocab_size: int | None
) -> bool:
    """The logits hold the whole vocabulary and no padded column."""
    whole = tp_group is None or dist.get_world_size(tp_group) == 1
    return whole and (vocab_size is None or logits.size(-1) <= vocab_size)


def _shard_layout(
    logits: torch.Tensor, tp_group: dist.ProcessGroup | None, vocab_size: int | None
) -> tuple[int, torch.Tensor | None]:
    """First global column of this shard, and a ``[V/tp]`` mask of padded columns (or None)."""
    partition = logits.size(-1)
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    start = rank * partition
    if vocab_size is None or start + partition <= vocab_size:
        return start, None
    columns = torch.arange(start, start + partition, device=logits.device)
    return start, columns >= vocab_size


def _label_index(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The labels as a ``[..., k]`` index into the vocabulary dim, and whether they were one per
    position (``[...]``, to be squeezed back)."""
    one_label = labels.dim() == logits.dim() - 1
    return (labels.unsqueeze(-1) if one_label else labels), one_label


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def _masked_logits(
    logits: torch.Tensor, dtype: torch.dtype, padded: torch.Tensor | None
) -> torch.Tensor:
    # Never modifies `logits`: .to() may return it unchanged, so masking is out of place.
    z = logits.to(dtype)
    return z if padded is None else z.masked_fill(padded, float("-inf"))


class _LabelLogProbs(torch.autograd.Function):
    """``log_softmax(logits)[label]`` of whole, unpadded logits, whose backward allocates nothing.

    Autograd's ``log_softmax`` + ``gather`` backward allocates two ``[..., V]`` buffers per call
    (a zero-filled one for the gather, the log-softmax gradient); at 16 MB each on CPU they come
    back as fresh pages every micro-batch, and faulting them in cost more than the arithmetic
    (about 90 ms of a 1.7 s update at the 25M benchmark shape). Here the forward keeps only the
    log-softmax output, and the backward turns that buffer into the gradient in place:
    ``d logp_label / dz = onehot(label) - p``, scaled by the upstream gradient. The saved buffer is
    consumed, so a second backward through the same graph fails loudly (autograd's version
    check) instead of reading it.
    """

    @staticmethod
    def forward(ctx, logits, labels):
        log_p = torch.log_softmax(logits.to(_compute_dtype(logits)), dim=-1)
        index, ctx.one_label = _label_index(logits, labels)
        ctx.logits_dtype = logits.dtype
        ctx.save_for_backward(log_p, index)
        picked = log_p.gather(-1, index)
        return picked.squeeze(-1) if ctx.one_label else picked

    @staticmethod
    def backward(ctx, grad_log_probs):
        log_p, index = ctx.saved_tensors
        upstream = grad_log_probs.unsqueeze(-1) if ctx.one_label else grad_log_probs
        upstream = upstream.to(log_p.dtype)
        # d sum_j g_j logp_{l_j} / dz = sum_j g_j onehot(l_j) - p * sum_j g_j
        grad = log_p.exp_().mul_(-upstream.sum(dim=-1, keepdim=True))
        grad.scatter_add_(-1, index, upstream)
        return grad.to(ctx.logits_dtype), None


class _LogProbsAndEntropy(torch.autograd.Function):
    """Fused vocab-parallel log-prob of the label and entropy, with a local backward.

    With ``lse = logsumexp(z)`` over all shards and ``p = exp(z - lse)``:
    ``d logp_label / dz = onehot(label) - p`` and ``d H / dz = -p * (log p + H)``.
    Backward recomputes ``p`` from the saved input logits and ``lse`` (one exp per
    element) instead of keeping a softmax copy alive between forward and backward.
    """

    @staticmethod
    def forward(ctx, logits, labels, tp_group, vocab_size, compute_entropy):
        dtype = _compute_dtype(logits)
        start, padded = _shard_layout(logits, tp_group, vocab_size)
        z = _masked_logits(logits, dtype, padded)
        partition = z.size(-1)

        z_max = z.max(dim=-1).values
        _all_reduce(z_max, dist.ReduceOp.MAX, tp_group)
        shifted = z - z_max.unsqueeze(-1)
        exp_shifted = shifted.exp()
        sum_exp = exp_shifted.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, tp_group)
        log_sum_exp = sum_exp.log()  # logsumexp(z) - z_max

        # Each label lives on exactly one shard; the others contribute 0 to the sum.
        index, one_label = _label_index(logits, labels)
        local_labels = index - start
        in_shard = (local_labels >= 0) & (local_labels < partition)
        gathered = shifted.gather(-1, local_labels.clamp(0, partition - 1))
        label_shifted = torch.where(in_shard, gathered, 0.0)
        _all_reduce(label_shifted, dist.ReduceOp.SUM, tp_group)
        log_probs = label_shifted - log_sum_exp.unsqueeze(-1)
        if one_label:
            log_probs = log_probs.squeeze(-1)

        entropy = None
        if compute_entropy:
            # H = log(sum exp(shifted)) - sum p * shifted; padded columns have p = 0 and
            # shifted = -inf, whose product is NaN, so they are zeroed explicitly.
            p_times_shifted = exp_shifted * shifted
            if padded is not None:
                p_times_shifted.masked_fill_(padded, 0.0)
            expected_shifted = p_times_shifted.sum(dim=-1)
            _all_reduce(expected_shifted, dist.ReduceOp.SUM, tp_group)
            entropy = log_sum_exp - expected_shifted / sum_exp

        ctx.tp_group, ctx.vocab_size, ctx.start = tp_group, vocab_size, start
        ctx.one_label = one_label
        ctx.save_for_backward(logits, index, z_max + log_sum_exp, entropy)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, index, lse, entropy = ctx.saved_tensors
        if grad_log_probs is not None and ctx.one_label:
            grad_log_probs = grad_log_probs.unsqueeze(-1)
        dtype = _compute_dtype(logits)
        _, padded = _shard_layout(logits, ctx.tp_group, ctx.vocab_size)
        log_p = _masked_logits(logits, dtype, padded) - lse.unsqueeze(-1)
        p = log_p.exp()

        if grad_entropy is not None and entropy is not None:
            grad = -p * (log_p + entropy.unsqueeze(-1))
            if padded is not None:
                grad.masked_fill_(padded, 0.0)
            grad.mul_(grad_entropy.unsqueeze(-1))
            if grad_log_probs is not None:
                grad.sub_(p * grad_log_probs.sum(dim=-1, keepdim=True))
        elif grad_log_probs is not None:
            # -p * g in place of p (not needed again): the same values as 0 - p * g, without a
            # zero-filled [..., V] buffer and a subtraction pass over it.
            grad = p.mul_(-grad_log_probs.sum(dim=-1, keepdim=True))
        else:
            grad = torch.zeros_like(p)
        if grad_log_probs is not None:
            local_labels = index - ctx.start
            in_shard = (local_labels >= 0) & (local_labels < p.size(-1))
            local_index = local_labels.clamp(0, p.size(-1) - 1)
            grad.scatter_add_(-1, local_index, (grad_log_probs * in_shard).to(dtype))
        return grad.to(logits.dtype), None, None, None, None
