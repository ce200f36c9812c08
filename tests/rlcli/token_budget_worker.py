"""Run under torchrun with 2 CPU processes. Used by test_token_budget.py.

    token_budget_worker.py LAYOUT HF_DIR OUT_JSON        (LAYOUT: dp2 or pp2)

1. For every ``actor.loss_agg_mode``: the actor loss (policy loss + KL loss - entropy bonus, the
   trainer's ``make_actor_loss`` with its global denominator) summed over token-budget
   micro-batches, and the gradients of that sum (after megatron's DP all-reduce), against fixed
   micro-batches of 2 rows of the same DP share.
2. The on-policy update without the old-log-prob pass (``update_actor`` with the
   ``update_forward`` plan) against the full path (a separate log-prob pass first, the
   ``actor_pass`` plan): the weights after the step, from two policies with the same initial
   weights.
Writes the largest differences (rank 0).
"""

from __future__ import annotations

import json
import random
import sys

import torch
import torch.distributed as dist

from rlcli.process_lifetime import exit_skipping_teardown

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def random_samples(seed: int, vocab: int):
    """9 groups x 3 samples; prompts of 2-9 and responses of 1-24 tokens (mixed lengths)."""
    from rlcli.rollout.batch import Sample

    rng = random.Random(seed)
    samples = []
    for group in range(9):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randrange(2, 10))]
        for _ in range(3):
            response = [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 25))]
            samples.append(
                Sample(group, prompt, response, [-rng.random() for _ in response], "stop", None)
            )
    return samples


def make_batch(samples, mesh, seed: int):
    from rlcli.rollout.batch import collate, take_dp_share

    mine, _ = take_dp_share(samples, mesh.dp, mesh.dp_rank)
    batch = collate(mine, 0)
    gen = torch.Generator().manual_seed(seed + mesh.dp_rank)
    mask = batch.loss_mask
    # Old log-probs near the engine's, so some PPO ratios clip and some do not.
    batch.old_log_probs = (-torch.rand(mask.shape, generator=gen) * 2) * mask
    batch.ref_log_probs = (-torch.rand(mask.shape, generator=gen) * 2) * mask
    batch.advantages = torch.randn(mask.shape, generator=gen) * mask
    return batch


def config(mode: str, extra: list[str] = ()):
    from rlcli.validation.loader import load_config

    return load_config(
        None,
        [
            "model.path=/unused",
            f"actor.loss_agg_mode={mode}",
            "actor.entropy_coeff=0.01",
            "actor.use_kl_loss=true",
            "rollout.max_tokens=24",
            "data.max_prompt_length=12",  # prompts of 2-9 tokens: a 60-token budget holds any row
            *extra,
        ],
    )


def policy(mesh, hf_dir: str, max_tokens: int = 0):
    from parallel.optim import OptimizerSettings
    from rlcli.model.trained_model import MicroBatching, TrainedModel

    # adam_eps = 1 and lr = 1: the first Adam step is g / (|g| + 1), nearly linear in the
    # gradient, so gradient differences show in the weights (a tiny eps would turn rounding
    # noise in ~0 gradients into full-size steps).
    settings = OptimizerSettings(
        lr=1.0, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1.0,
        clip_grad=0.0, warmup_steps=0, total_steps=10, decay_style="constant",
        use_distributed_optimizer=False,
    )  # fmt: skip
    return TrainedModel(mesh, hf_dir, optim=settings, micro_batching=MicroBatching(2, max_tokens))


def loss_and_grads(actor, batch, cfg, mesh, max_tokens: int):
    """Summed actor loss over this rank's micro-batches and every parameter's gradient."""
    import algorithms
    from parallel.micro_batches import micro_batches
    from parallel.schedule import forward_backward
    from rlcli.model.dp_stats import DataParallelStats
    from rlcli.train.actor_update import make_actor_loss

    for chunk in actor.models:
        chunk.zero_grad_buffer()
    parts = micro_batches(batch, 2, equal_sizes=mesh.pp > 1, max_tokens=max_tokens)
    # This rank's share of the global denominator (DDP averages gradients over DP).
    denominator = algorithms.agg_loss_denominator(
        batch.loss_mask, cfg.actor.loss_agg_mode, norm_length=cfg.rollout.max_tokens
    ).double()
    denominator = (DataParallelStats(mesh).sum(denominator) / mesh.dp).float()
    results = forward_backward(
        actor.models, mesh, parts, make_actor_loss(cfg, denominator),
        forward_only=False, compute_entropy=True,
    )  # fmt: skip
    loss = sum(m["actor/pg_loss"] - 0.01 * m["actor/entropy"] + 0.001 * m["actor/kl_loss"]
               for m in (r.report.metrics for r in results))  # fmt: skip
    grads = [p.main_grad.clone() for m in actor.models for p in m.parameters()]
    widths = [p.input_ids.numel() for p in parts]
    return loss, grads, widths


def weights(actor) -> list[torch.Tensor]:
    return [p.detach().clone() for m in actor.models for p in m.parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def main() -> None:
    layout, hf_dir, out = sys.argv[1:4]
    from parallel.mesh import init_parallel
    from rlcli.train.actor_update import update_actor

    mesh = init_parallel(tp=1, pp=2 if layout == "pp2" else 1, seed=0)
    actor = policy(mesh, hf_dir)
    vocab = actor.hf_config.vocab_size
    batch = make_batch(random_samples(5, vocab), mesh, seed=7)
    result: dict = {"layout": layout, "dp": mesh.dp, "pp": mesh.pp}
    for mode in AGG_MODES:
        cfg = config(mode)
        fixed_loss, fixed_grads, fixed_sizes = loss_and_grads(actor, batch, cfg, mesh, 0)
        budget_loss, budget_grads, budget_sizes = loss_and_grads(actor, batch, cfg, mesh, 60)
        total = torch.tensor([fixed_loss, budget_loss], dtype=torch.float64)
        if mesh.dp > 1:  # the rank shares add up to the full-batch loss
            dist.all_reduce(total, group=mesh.dp_group)
        result[mode] = {
            "loss": total.tolist(),
            "grad_diff": max_diff(fixed_grads, budget_grads),
            "grad_scale": max(g.abs().max().item() for g in fixed_grads),
            "padded_tokens": [sum(fixed_sizes), sum(budget_sizes)],
            "micro_batches": [len(fixed_sizes), len(budget_sizes)],
        }

    # On-policy: the same update with and without the separate old-log-prob pass (KL in the
    # reward, which the update does not read, makes the plan take the separate pass).
    from dataclasses import replace

    cfg = config("token-mean")
    cfg_full = config("token-mean", ["algorithm.use_kl_in_reward=true"])
    assert (cfg.old_log_prob_plan, cfg_full.old_log_prob_plan) == ("update_forward", "actor_pass")
    full, skip = policy(mesh, hf_dir, 60), policy(mesh, hf_dir, 60)
    before = weights(full)
    full_batch = replace(batch, old_log_probs=full.forward(batch))
    metrics_full = update_actor(full, full_batch, cfg_full, fewest_groups=1)
    metrics_skip = update_actor(skip, replace(batch, old_log_probs=None), cfg, fewest_groups=1)
    result["on_policy"] = {
        "weight_diff": max_diff(weights(full), weights(skip)),
        "weight_change": max_diff(weights(full), before),
        "grad_norm": [metrics_full["actor/grad_norm"], metrics_skip["actor/grad_norm"]],
        "kl_to_ref_skip": metrics_skip.get("actor/kl_to_ref"),
        "logprob_diff_mean_skip": metrics_skip.get("rollout/logprob_diff_mean"),
    }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
