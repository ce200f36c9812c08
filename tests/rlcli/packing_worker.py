"""Run under torchrun with 2 CPU processes. Used by test_packing.py.

    packing_worker.py HF_DIR CRITIC_HF_DIR OUT_JSON

For each layout (TP2, PP2, DP2: TP1 on each rank), in one launch (megatron's model-parallel
state is rebuilt between layouts, the default process group is kept):
1. sdpa vs local: the logits of megatron's local layers with model.attention_backend=sdpa
   against the same layers with megatron's unfused attention (and both against HF); the
   response log-probs of the two.
2. packed vs padded (actor.pack_sequences, MicroBatching.pack): per-row log-probs and entropy of every position;
   for every actor.loss_agg_mode the actor loss (the trainer's make_actor_loss, its global
   denominator) summed over packed micro-batches and the gradients of that sum (after
   megatron's DP all-reduce) against fixed micro-batches of 2 rows; one on-policy update
   (update_actor) from the same weights, packed and padded: the weights after it.
3. the PPO critic's values (TrainedModel(head=ValueHead()).forward) packed and padded.
Rank 0 writes the largest differences (and the scales they are measured against).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from parallel.model_options import ModelBuildOptions
from rlcli.process_lifetime import exit_skipping_teardown
from tests.rlcli.token_budget_worker import AGG_MODES, config, make_batch, random_samples

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}


def optim_settings():
    from parallel.optim import OptimizerSettings

    # lr = 1, adam_eps = 1: the first step is nearly linear in the gradient (token_budget_worker)
    return OptimizerSettings(
        lr=1.0, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1.0,
        clip_grad=0.0, warmup_steps=0, total_steps=10, decay_style="constant",
        use_distributed_optimizer=False,
    )  # fmt: skip


def trained(mesh, hf_dir: str, pack: bool, value: bool = False, attention: str = "sdpa"):
    """A trainable model as rlcli.train.build builds it (a policy, or with ``value`` a critic):
    micro-batches of 2 rows, or packed within a 40-token budget."""
    from rlcli.model.heads import LanguageModelHead, ValueHead
    from rlcli.model.trained_model import MicroBatching, TrainedModel

    head = ValueHead() if value else LanguageModelHead()
    return TrainedModel(
        mesh, hf_dir, head=head, optim=optim_settings(),
        micro_batching=MicroBatching(2, 40 * pack, pack=pack),
        model_options=ModelBuildOptions(attention_backend=attention),
    )  # fmt: skip


def full_logits(models, mesh, input_ids) -> torch.Tensor | None:
    """[b, s, V] logits through megatron's schedule, TP-gathered; None off the last stage."""
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)

    def forward_step(data_iterator, model):
        output = model(input_ids, positions, attention_mask=None)
        return output, lambda out: (out.sum() * 0, {"logits": out.detach()})

    with torch.no_grad():
        results = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(()), model=models,
            num_microbatches=1, seq_length=input_ids.shape[1],
            micro_batch_size=input_ids.shape[0], forward_only=True,
        )  # fmt: skip
    if not mesh.is_last_stage:
        return None
    local = results[0]["logits"]
    shards = [torch.empty_like(local) for _ in range(mesh.tp)]
    dist.all_gather(shards, local.contiguous(), group=mesh.tp_group)
    return torch.cat(shards, dim=-1)[..., : models[0].unpadded_vocab_size]


def attention_parity(mesh, hf_dir: str, batch) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from parallel.hf_model import load_hf_model
    from rlcli.model.trained_model import MicroBatching, TrainedModel

    ids = batch.input_ids
    logits = {}
    for attention in ("local", "sdpa"):
        models = load_hf_model(hf_dir, mesh, options=ModelBuildOptions(attention_backend=attention))
        logits[attention] = full_logits(models, mesh, ids)
    log_probs = {
        attention: TrainedModel(
            mesh, hf_dir, micro_batching=MicroBatching(4),
            model_options=ModelBuildOptions(attention_backend=attention),
        ).forward(batch)
        for attention in ("local", "sdpa")
    }  # fmt: skip
    mask = batch.response_mask
    out = {"logprob_sdpa_vs_local": ((log_probs["sdpa"] - log_probs["local"]).abs() * mask).max()}
    if logits["local"] is not None:
        with torch.no_grad():
            hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(ids).logits
        out["logits_sdpa_vs_local"] = (logits["sdpa"] - logits["local"]).abs().max()
        out["logits_local_vs_hf"] = (logits["local"] - hf).abs().max()
        out["logits_sdpa_vs_hf"] = (logits["sdpa"] - hf).abs().max()
        out["logits_scale"] = hf.abs().max()
    return {k: float(v) for k, v in out.items()}


def per_row(actor, batch, pack: bool) -> dict[str, torch.Tensor]:
    """log_probs and entropy [B, S-1] of every row, put back by row number."""
    from parallel.micro_batches import micro_batches
    from parallel.schedule import forward_backward
    from parallel.step_types import MicroBatch

    rows = MicroBatch(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        row_index=torch.arange(batch.input_ids.shape[0]),
    )
    parts = micro_batches(rows, 2, equal_sizes=actor.mesh.pp > 1, max_tokens=40 * pack, pack=pack)
    results = forward_backward(
        actor.models, actor.mesh, parts, None, forward_only=True, compute_entropy=True,
        pack_sequences=pack,
    )  # fmt: skip
    shape = (rows.input_ids.shape[0], rows.input_ids.shape[1] - 1)
    out = {name: torch.zeros(shape) for name in ("log_probs", "entropy")}
    for part, result in zip(parts, results, strict=True):
        for name in out:
            values = getattr(result.outputs, name).cpu()
            out[name][part.row_index, : values.shape[1]] = values
    return out


def loss_and_grads(actor, batch, cfg, mesh, pack: bool):
    """Summed actor loss over this rank's micro-batches (all-reduced over DP), every parameter's
    gradient, and the real tokens of each micro-batch."""
    import algorithms
    from parallel.micro_batches import micro_batches
    from parallel.schedule import forward_backward
    from rlcli.model.dp_stats import DataParallelStats
    from rlcli.train.actor_update import make_actor_loss

    for chunk in actor.models:
        chunk.zero_grad_buffer()
    parts = micro_batches(batch, 2, equal_sizes=mesh.pp > 1, max_tokens=40 * pack, pack=pack)
    # This rank's share of the global denominator (DDP averages gradients over DP).
    denominator = algorithms.agg_loss_denominator(
        batch.loss_mask, cfg.actor.loss_agg_mode, norm_length=cfg.rollout.max_tokens
    ).double()
    denominator = (DataParallelStats(mesh).sum(denominator) / mesh.dp).float()
    results = forward_backward(
        actor.models, mesh, parts, make_actor_loss(cfg, denominator),
        forward_only=False, compute_entropy=True, pack_sequences=pack,
    )  # fmt: skip
    loss = sum(m["actor/pg_loss"] - 0.01 * m["actor/entropy"] + 0.001 * m["actor/kl_loss"]
               for m in (r.report.metrics for r in results))  # fmt: skip
    total = torch.tensor([loss], dtype=torch.float64)
    if mesh.dp > 1:
        dist.all_reduce(total, group=mesh.dp_group)
    grads = [p.main_grad.clone() for m in actor.models for p in m.parameters()]
    return total.item(), grads, [int(p.attention_mask.sum()) for p in parts]


def weights(policy) -> list[torch.Tensor]:
    return [p.detach().clone() for m in policy.models for p in m.parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def packing_parity(mesh, hf_dir: str, critic_dir: str, batch) -> dict:
    from dataclasses import replace

    from rlcli.train.actor_update import update_actor

    actor = trained(mesh, hf_dir, pack=True)
    padded, packed = per_row(actor, batch, False), per_row(actor, batch, True)
    label_mask = batch.attention_mask[:, 1:].float()
    out: dict = {
        name: ((padded[name] - packed[name]).abs() * label_mask).max().item()
        for name in ("log_probs", "entropy")
    }
    for mode in AGG_MODES:
        cfg = config(mode)
        fixed_loss, fixed_grads, _ = loss_and_grads(actor, batch, cfg, mesh, pack=False)
        packed_loss, packed_grads, tokens = loss_and_grads(actor, batch, cfg, mesh, pack=True)
        out[mode] = {
            "loss": [fixed_loss, packed_loss],
            "grad_diff": max_diff(fixed_grads, packed_grads),
            "grad_scale": max(g.abs().max().item() for g in fixed_grads),
            "packed_tokens": tokens,
        }
    # The trainer's update, packed and padded, from the same weights (on-policy: one pass).
    cfg = config("token-mean")
    on_policy = replace(batch, old_log_probs=None)
    runs = {}
    for pack in (False, True):
        policy = trained(mesh, hf_dir, pack=pack)
        before = weights(policy)
        update_actor(policy, on_policy, cfg, fewest_groups=1)
        runs[pack] = weights(policy)
    out["update"] = {
        "weight_diff": max_diff(runs[False], runs[True]),
        "weight_change": max_diff(runs[False], before),
    }
    # The critic's values through TrainedModel.forward, one model read packed and padded.
    critic = trained(mesh, critic_dir, pack=True, value=True)
    values = {}
    for pack in (False, True):
        critic.micro_batching = replace(critic.micro_batching, pack=pack)
        values[pack] = critic.forward(batch)
    out["values"] = (values[False] - values[True]).abs().max().item()
    out["values_scale"] = values[False].abs().max().item()
    return out


def main() -> None:
    hf_dir, critic_dir, out_path = sys.argv[1:4]
    from parallel.mesh import init_parallel

    result = {}
    for name, (tp, pp) in LAYOUTS.items():
        mesh = init_parallel(tp=tp, pp=pp, seed=0)
        batch = make_batch(random_samples(5, 251), mesh, seed=7)
        row = {"dp": mesh.dp, **attention_parity(mesh, hf_dir, batch)}
        row.update(packing_parity(mesh, hf_dir, critic_dir, batch))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, row)
        result[name] = gathered
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
