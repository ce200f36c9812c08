"""Supervised warm start on Megatron: cross-entropy on the response tokens of prompt/response pairs.

Uses the same model, batch layout and forward/backward schedule as RL; the result is written as
an ordinary HF model directory, which RL (and the rollout engine) then start from.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from rlcli.batch import RolloutBatch, Sample, collate, response_values, split_evenly
from rlcli.data import read_sft_pairs
from rlcli.errors import UserError
from rlcli.inputs import RunInputs
from rlcli.trained_model import TrainedModel


def tokenize_pairs(pairs: list[tuple[str, str]], tokenizer) -> list[Sample]:
    eos = tokenizer.eos_token_id
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    responses = tokenizer([r for _, r in pairs], add_special_tokens=False)["input_ids"]
    return [
        Sample(
            group=i,
            prompt_ids=p,
            response_ids=r + [eos],
            engine_log_probs=[0.0] * (len(r) + 1),
            finish_reason="stop",
            item=None,
        )
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True))
    ]


def make_sft_loss(denominator: float):
    def loss_fn(outputs: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]):
        mb = RolloutBatch.from_tensors(tensors)
        mask = mb.loss_mask.to(outputs["log_probs"].device)
        log_prob = response_values(outputs["log_probs"], mb.response_index)
        nll = -(log_prob * mask).sum() / denominator
        return nll, {"sft/loss": nll.item()}

    return loss_fn


def sft_warm_start(
    c: RunInputs,
    build_actor: Callable[[], TrainedModel],
    files: list[str],
    out_dir: Path,
    log: Callable[[str], None] = print,
) -> Path:
    """Train ``sft.steps`` steps on ``files`` from a fresh ``build_actor()`` (built once the
    inputs are checked); save it as HF into ``out_dir``."""
    from parallel.convert import save_hf_checkpoint

    cfg, mesh = c.cfg, c.mesh
    if not files:
        raise UserError(
            "sft.steps > 0 needs SFT pairs: set sft.train_files (JSONL with prompt/response)"
        )
    samples = tokenize_pairs([pair for f in files for pair in read_sft_pairs(f)], c.tokenizer)
    if len(samples) < cfg.sft.batch_size:
        raise UserError(f"sft.batch_size={cfg.sft.batch_size} exceeds the {len(samples)} SFT pairs")
    actor = build_actor()
    rng = np.random.default_rng(cfg.trainer.seed)
    start = time.perf_counter()
    for step in range(1, cfg.sft.steps + 1):
        chosen = [samples[i] for i in rng.choice(len(samples), cfg.sft.batch_size, replace=False)]
        local = split_evenly(chosen, mesh.dp)[mesh.dp_rank]
        batch = collate(local, c.tokenizer.pad_token_id)
        tokens = sum(len(s.response_ids) for s in chosen)  # of the whole batch, all DP ranks
        result = actor.train_step(batch.tensors(), make_sft_loss(tokens / mesh.dp))
        if step % 50 == 0 or step == cfg.sft.steps:
            loss = sum(m["sft/loss"] for m in result["micro_batch_metrics"])
            log(
                f"sft step {step}/{cfg.sft.steps}: loss {loss:.4f} "
                f"({time.perf_counter() - start:.1f} s)"
            )
    save_hf_checkpoint(actor.models, mesh, str(out_dir), actor.hf_config, tokenizer_dir=c.model_dir)
    if dist.is_initialized():
        dist.barrier()
    del actor
    return out_dir
