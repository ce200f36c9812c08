"""torchrun worker (2 processes): parallel.checkpoint across layouts, in one launch.

    checkpoint_worker.py HF_DIR CKPT_ROOT

1. TP2: one train_step, save model + optimizer + scheduler; record the full (TP-gathered)
   logits and the results of a second train_step.
2. TP2, fresh random model and optimizer: load everything, take the second step again: the
   loss, gradient norm, learning rate and weights equal the uninterrupted run. The same from a
   checkpoint written before any optimizer step (no Adam moments in it).
3. TP1 (x DP2), fresh random model: load the model: full logits equal those of step 1.
   Also load the optimizer written at TP2 and take the second step: equals the TP2 run.
   Then save with the distributed optimizer (sharded over DP2); resuming it refuses with a
   clear error under torch's Adam (megatron-core limitation), else must match exactly.
4. PP2, fresh random model: load the model of both checkpoints: log-probs equal.
Prints measured differences from rank 0; exits non-zero on a failed check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from transformers import AutoConfig

from parallel.checkpoint import load_checkpoint, save_checkpoint
from parallel.convert import load_hf_weights
from parallel.forward_passes import forward_log_probs
from parallel.mesh import Mesh, init_parallel
from parallel.model import build_model
from parallel.optim import OptimizerSettings, build_optimizer, train_step, wrap_for_training
from parallel.step_types import LossReport, MicroBatch, ModelOutputs
from rlcli.process_lifetime import exit_skipping_teardown

ROWS, SEQ = 4, 9


def make_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(6)
    input_ids = torch.randint(0, vocab_size, (ROWS, SEQ), generator=generator)
    return input_ids, torch.ones(ROWS, SEQ, dtype=torch.long)


def nll_loss(dp: int):
    """Summed NLL scaled so that DP averaging gives the same gradient at every layout."""

    def loss_fn(outputs: ModelOutputs, micro_batch: MicroBatch) -> tuple[torch.Tensor, LossReport]:
        nll = -outputs.log_probs.sum()
        return nll * dp / 64.0, LossReport({"nll": nll.item()})

    return loss_fn


def training_state(mesh: Mesh, hf_config, hf_dir: str | None, distributed: bool = False):
    """Models (HF weights, or megatron's random init when hf_dir is None) + optimizer."""
    models = build_model(hf_config, mesh)
    if hf_dir is not None:
        load_hf_weights(models, mesh, hf_dir)
    models = wrap_for_training(models, mesh, use_distributed_optimizer=distributed)
    optimizer, scheduler = build_optimizer(
        models,
        OptimizerSettings(
            use_distributed_optimizer=distributed,
            lr=1e-3,
            min_lr=1e-4,
            weight_decay=0.01,
            warmup_steps=1,
            total_steps=5,
            decay_style="cosine",
        ),
    )
    return models, optimizer, scheduler


def step(models, mesh, optimizer, scheduler, batch) -> dict:
    input_ids, attention_mask = batch
    rows = ROWS // mesh.dp
    mine = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
    micro_batches = [
        MicroBatch(input_ids=ids, attention_mask=mask)
        for ids, mask in zip(input_ids[mine].split(1), attention_mask[mine].split(1), strict=True)
    ]
    result = train_step(models, mesh, optimizer, scheduler, micro_batches, nll_loss(mesh.dp))
    nll = torch.tensor(sum(r.metrics["nll"] for r in result.reports), dtype=torch.float64)
    dist.all_reduce(nll, group=mesh.dp_group)
    return {"grad_norm": result.grad_norm, "lr": result.lr, "loss": nll.item() / 64.0}


def full_logits(models, mesh: Mesh, input_ids: torch.Tensor) -> torch.Tensor:
    """[b, s, padded V] logits of a single-stage model, TP shards gathered."""
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.no_grad():
        shard = models[0](input_ids, positions, attention_mask=None)
    shards = [torch.empty_like(shard) for _ in range(mesh.tp)]
    dist.all_gather(shards, shard.contiguous(), group=mesh.tp_group)
    return torch.cat(shards, dim=-1)


def weights_as_hf(models, mesh: Mesh) -> dict[str, torch.Tensor]:
    from parallel.convert import iter_hf_weights

    return {name: tensor.clone() for name, tensor in iter_hf_weights(models, mesh)}


def max_weight_diff(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max((weights[k] - reference[k]).abs().max().item() for k in reference)


def main() -> None:
    hf_dir, ckpt_root = sys.argv[1], Path(sys.argv[2])
    hf_config = AutoConfig.from_pretrained(hf_dir)
    batch = make_batch(hf_config.vocab_size)
    ckpt = ckpt_root / "step1"
    report: dict[str, float] = {}

    # 1. Write at TP2 after one step; remember what the uninterrupted run does next.
    mesh = init_parallel(tp=2, seed=1)
    models, optimizer, scheduler = training_state(mesh, hf_config, hf_dir)
    # Saved before any optimizer step: Adam has no moments yet (a run whose first steps were all
    # filtered away); resuming it must work and continue exactly.
    save_checkpoint(ckpt_root / "step0", models, mesh, optimizer, scheduler)
    first = step(models, mesh, optimizer, scheduler, batch)
    first_weights = weights_as_hf(models, mesh)
    save_checkpoint(ckpt, models, mesh, optimizer, scheduler)
    ref_logits = full_logits(models, mesh, batch[0])
    ref_log_probs = forward_log_probs(models, mesh, *batch, micro_batch_size=2)
    ref_next = step(models, mesh, optimizer, scheduler, batch)
    ref_weights = weights_as_hf(models, mesh)

    # 2. Resume at the same layout from a different random start.
    models, optimizer, scheduler = training_state(mesh, hf_config, None)
    assert (full_logits(models, mesh, batch[0]) - ref_logits).abs().max() > 1e-2
    load_checkpoint(ckpt, models, mesh, optimizer, scheduler)
    resumed = step(models, mesh, optimizer, scheduler, batch)
    weights = weights_as_hf(models, mesh)
    report["resume_loss_diff"] = abs(resumed["loss"] - ref_next["loss"])
    report["resume_grad_norm_diff"] = abs(resumed["grad_norm"] - ref_next["grad_norm"])
    report["resume_weight_diff"] = max_weight_diff(weights, ref_weights)
    assert resumed["lr"] == ref_next["lr"], (resumed["lr"], ref_next["lr"])
    assert report["resume_loss_diff"] == 0.0 and report["resume_grad_norm_diff"] == 0.0, report
    assert report["resume_weight_diff"] == 0.0, report

    models, optimizer, scheduler = training_state(mesh, hf_config, None)
    load_checkpoint(ckpt_root / "step0", models, mesh, optimizer, scheduler)
    resumed = step(models, mesh, optimizer, scheduler, batch)
    weights = weights_as_hf(models, mesh)
    report["resume_before_any_step_weight_diff"] = max_weight_diff(weights, first_weights)
    assert resumed["grad_norm"] == first["grad_norm"], (resumed, first)
    assert report["resume_before_any_step_weight_diff"] == 0.0, report
    parallel_state.destroy_model_parallel()

    # 3. Read at TP1 (2 data-parallel replicas): model, then model + optimizer written at TP2.
    mesh = init_parallel(tp=1, seed=2)
    models, optimizer, scheduler = training_state(mesh, hf_config, None)
    load_checkpoint(ckpt, models, mesh)
    logits = full_logits(models, mesh, batch[0])
    # TP2 pads the vocabulary to 252 rows, TP1 holds 251: compare the real token columns.
    vocab = hf_config.vocab_size
    report["tp1_logits_diff"] = (logits[..., :vocab] - ref_logits[..., :vocab]).abs().max().item()
    assert report["tp1_logits_diff"] < 1e-5, report

    models, optimizer, scheduler = training_state(mesh, hf_config, None)
    load_checkpoint(ckpt, models, mesh, optimizer, scheduler)
    resharded = step(models, mesh, optimizer, scheduler, batch)
    weights = weights_as_hf(models, mesh)
    report["tp1_optimizer_grad_norm_diff"] = abs(resharded["grad_norm"] - ref_next["grad_norm"])
    report["tp1_optimizer_weight_diff"] = max_weight_diff(weights, ref_weights)
    assert report["tp1_optimizer_grad_norm_diff"] < 1e-5, report
    assert report["tp1_optimizer_weight_diff"] < 1e-5, report

    # Distributed optimizer (sharded over the 2 DP ranks): write after one step ...
    dist_ckpt = ckpt_root / "distributed_step1"
    models, optimizer, scheduler = training_state(mesh, hf_config, hf_dir, distributed=True)
    step(models, mesh, optimizer, scheduler, batch)
    save_checkpoint(dist_ckpt, models, mesh, optimizer, scheduler)
    dist_ref_log_probs = forward_log_probs(models, mesh, *batch, micro_batch_size=2)
    dist_next = step(models, mesh, optimizer, scheduler, batch)
    dist_weights = weights_as_hf(models, mesh)
    # ... and resume it at the same layout where megatron-core can (fused Adam from TE / Apex).
    models, optimizer, scheduler = training_state(mesh, hf_config, None, distributed=True)
    if isinstance(optimizer.chained_optimizers[0].optimizer, torch.optim.Adam):
        try:
            load_checkpoint(dist_ckpt, models, mesh, optimizer, scheduler)
        except NotImplementedError as error:
            assert "Transformer Engine or Apex" in str(error)
        else:
            raise AssertionError("expected the torch-Adam distributed optimizer load to refuse")
    else:
        load_checkpoint(dist_ckpt, models, mesh, optimizer, scheduler)
        resumed = step(models, mesh, optimizer, scheduler, batch)
        weights = weights_as_hf(models, mesh)
        report["dist_opt_resume_weight_diff"] = max_weight_diff(weights, dist_weights)
        assert resumed["grad_norm"] == dist_next["grad_norm"], (resumed, dist_next)
        assert report["dist_opt_resume_weight_diff"] == 0.0, report
    parallel_state.destroy_model_parallel()

    # 4. Read the models of both checkpoints at PP2.
    mesh = init_parallel(tp=1, pp=2, seed=3)
    models, _, _ = training_state(mesh, hf_config, None)
    load_checkpoint(ckpt, models, mesh)
    log_probs = forward_log_probs(models, mesh, *batch, micro_batch_size=2)
    report["pp2_log_probs_diff"] = (log_probs - ref_log_probs).abs().max().item()
    assert report["pp2_log_probs_diff"] < 1e-5, report
    load_checkpoint(dist_ckpt, models, mesh)
    log_probs = forward_log_probs(models, mesh, *batch, micro_batch_size=2)
    report["pp2_from_dist_opt_log_probs_diff"] = (log_probs - dist_ref_log_probs).abs().max().item()
    assert report["pp2_from_dist_opt_log_probs_diff"] < 1e-5, report
    parallel_state.destroy_model_parallel()

    if dist.get_rank() == 0:
        print(f"CHECKPOINT {report}", flush=True)
        print("CHECKPOINT_WORKER_OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
