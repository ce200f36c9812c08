"""``rlcli rm``: train a reward model on pairwise preference rows with the Bradley-Terry loss on
Megatron (the trainer's TP / PP / DP layout), report its held-out pairwise accuracy, checkpoint,
and write it as an HF ``*ForSequenceClassification`` folder.

    report = train_reward_model(cfg, mesh, model_options, log=print)   # collective, every rank

The model starts from ``rm.init_path`` (default ``model.path``): a language model (the SFT
policy, typically) gives its transformer and a fresh score head; a reward model is trained
further. Its tokenizer and chat template tokenise the pairs (``rlcli.data.preferences``). Each
step draws ``rm.batch_size`` pairs (a seeded permutation per epoch, the same on every rank; each
DP rank takes its share). Checkpoints (``rm.save_freq``) go to
``<trainer.output_dir>/rm_checkpoints`` through ``rlcli.train.save_resume``, as an RL run's do: a
run resumes as ``trainer.resume`` says, from the newest intact one for ``auto`` (a damaged newest
one is skipped, saying so). The result lands in ``rm.out_dir`` (replaced whole, never
left half-written) and a JSON report in ``<trainer.output_dir>/reward_model_report.json``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from parallel.mesh import Mesh
from parallel.model_options import ModelBuildOptions
from parallel.optim import OptimizerSettings
from parallel.preference_pairs import TokenizedPairs
from rlcli.config.schema import RLConfig
from rlcli.errors import UserError
from rlcli.model.heads import ScoreHead
from rlcli.model.trained_model import MicroBatching, TrainedModel
from rlcli.run.checkpoints import CheckpointManager
from rlcli.run.state import RunState
from rlcli.train.save_resume import CheckpointedModel, RunCheckpoints, replacing_folder

REPORT_FILE = "reward_model_report.json"


@dataclass
class RewardModelReport:
    """What a reward-model training did; accuracies are held-out pairwise accuracies (None
    without ``rm.val_files``)."""

    out_dir: str
    steps: int
    train_pairs: int
    val_pairs: int
    dropped_too_long: int
    val_accuracy_before: float | None
    val_accuracy_after: float | None
    final_loss: float | None
    seconds: float
    history: list[dict[str, Any]] = field(default_factory=list)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _preference_files(cfg: RLConfig, mesh: Mesh) -> tuple[list[str], list[str]]:
    rm = cfg.rm
    if rm.synthetic != "arith":
        return list(rm.train_files), list(rm.val_files)
    from rlcli.data import write_arith_preferences

    data_dir = Path(cfg.trainer.output_dir) / "data"
    if mesh.rank == 0 and not (data_dir / "rm_val.jsonl").exists():
        write_arith_preferences(str(data_dir))
    _barrier()
    train = list(rm.train_files) or [str(data_dir / "rm_train.jsonl")]
    return train, list(rm.val_files) or [str(data_dir / "rm_val.jsonl")]


def batch_indices(step: int, num_pairs: int, batch_size: int, seed: int) -> list[int]:
    """The pairs of step `step` (from 1): consecutive slices of a per-epoch permutation (the
    pairs left over at an epoch's end wait for the next one)."""
    per_epoch = num_pairs // batch_size
    epoch, position = divmod(step - 1, per_epoch)
    order = np.random.default_rng((seed, epoch)).permutation(num_pairs)
    return order[position * batch_size : (position + 1) * batch_size].tolist()


def _load_pairs(
    files: list[str], key: str, tokenizer: Any, cfg: RLConfig
) -> tuple[TokenizedPairs, int]:
    from rlcli.data.preferences import read_preference_rows, tokenize_preferences

    rows = read_preference_rows(files, key)
    pairs, dropped = tokenize_preferences(
        rows,
        tokenizer,
        max_length=cfg.rm.max_length,
        apply_chat_template=cfg.data.apply_chat_template,
    )
    if not len(pairs):
        raise UserError(
            f"{key}: every pair of {', '.join(files)} is longer than rm.max_length="
            f"{cfg.rm.max_length} tokens; raise rm.max_length"
        )
    return pairs, dropped


def _init_dir(cfg: RLConfig, init_path: str | None) -> tuple[str, bool]:
    """The folder to start from (`init_path`, else ``rm.init_path``, else ``model.path``) and
    whether it is a reward model already."""
    from parallel.reward_model import reward_model_problem

    if init_path is not None:
        key, path = "the RL start model", init_path
    elif cfg.rm.init_path:
        key, path = "rm.init_path", cfg.rm.init_path
    else:
        key, path = "model.path", cfg.model.path
    problem = reward_model_problem(path, from_language_model=True)
    if problem is not None:
        raise UserError(
            f"{key}={path}: {problem} (a reward model starts from an HF language or reward "
            "model; for the RLHF quickstart run the SFT stage first)"
        )
    return path, reward_model_problem(path) is None


def _build(
    cfg: RLConfig,
    mesh: Mesh,
    init_dir: str,
    is_reward_model: bool,
    pad_token_id: int,
    model_options: ModelBuildOptions,
) -> TrainedModel:
    """The reward model to train: the trained-model core with a score head, ``rm.*``'s Adam
    (betas and eps as ``actor.*``) and constant LR after warmup, micro-batches of
    ``rm.micro_batch_size`` (pairs to train, sequences to score) or ``rm.max_tokens``."""
    rm, actor = cfg.rm, cfg.actor
    settings = OptimizerSettings(
        lr=rm.lr,
        min_lr=0.0,
        weight_decay=rm.weight_decay,
        adam_beta1=actor.adam_beta1,
        adam_beta2=actor.adam_beta2,
        adam_eps=actor.adam_eps,
        clip_grad=rm.grad_clip,
        warmup_steps=rm.lr_warmup_steps,
        total_steps=rm.steps,
        decay_style="constant",
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
    )
    return TrainedModel(
        mesh,
        init_dir,
        micro_batching=MicroBatching(rm.micro_batch_size, rm.max_tokens),
        dtype=cfg.model.dtype,
        head=ScoreHead(
            from_language_model=not is_reward_model,
            pad_token_id=None if is_reward_model else pad_token_id,
        ),
        optim=settings,
        model_options=model_options,
    )


def train_reward_model(
    cfg: RLConfig,
    mesh: Mesh,
    model_options: ModelBuildOptions,
    log: Callable[[str], None] | None = None,
    init_path: str | None = None,
    extra_pairs: tuple[list[str], list[str]] = ([], []),
) -> RewardModelReport:
    """Train, evaluate, checkpoint and export a reward model as ``cfg.rm`` says (module
    docstring); `model_options`: its ``parallel.model.build_model`` layout options (the actor's:
    ``rlcli.train.inputs.model_options(cfg, cfg.actor)``); `init_path` (the RLHF stage of ``rlcli
    train``: the SFT policy) replaces ``rm.init_path``; `extra_pairs`: training and held-out
    pair files added to ``rm.*``'s (``rlcli.train.on_policy_pairs``). Collective: every rank of `mesh`
    calls it with the same config."""
    from transformers import AutoTokenizer

    from parallel.convert import save_hf_checkpoint
    from parallel.reward_training import bradley_terry_step, pairwise_accuracy
    from rlcli.validation.rewards import check_reward_model_training

    say = log if log is not None and mesh.rank == 0 else (lambda message: None)
    rm = cfg.rm
    check_reward_model_training(cfg, mesh.dp)
    start = time.perf_counter()
    init_dir, is_reward_model = _init_dir(cfg, init_path)
    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    pad_token_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    if pad_token_id is None:
        raise UserError(f"the tokenizer of {init_dir} has neither a pad nor an EOS token")
    train_files, val_files = _preference_files(cfg, mesh)
    train_files, val_files = train_files + extra_pairs[0], val_files + extra_pairs[1]
    train, dropped = _load_pairs(train_files, "rm.train_files", tokenizer, cfg)
    val, val_dropped = (
        _load_pairs(val_files, "rm.val_files", tokenizer, cfg) if val_files else (None, 0)
    )
    if rm.batch_size > len(train):
        raise UserError(f"rm.batch_size={rm.batch_size} exceeds the {len(train)} training pairs")
    say(
        f"reward model from {init_dir} ({'reward model' if is_reward_model else 'fresh score head'}"
        f", tp={mesh.tp} pp={mesh.pp} dp={mesh.dp}): {len(train)} training pairs, "
        f"{len(val) if val else 0} held-out"
    )
    model = _build(cfg, mesh, init_dir, is_reward_model, pad_token_id, model_options)
    pad_id = model.hf_config.pad_token_id  # the reward model's: decides the scored position
    sizes = {
        "pad_token_id": pad_id,
        "micro_batch_size": rm.micro_batch_size,
        "max_tokens": rm.max_tokens,
    }

    def held_out() -> float | None:
        if val is None:
            return None
        return pairwise_accuracy(model.score, mesh, val, pad_token_id=pad_id)["accuracy"]

    checkpoints = RunCheckpoints(
        CheckpointManager(
            Path(cfg.trainer.output_dir) / "rm_checkpoints", keep_last=cfg.checkpoint.keep_last
        ),
        [CheckpointedModel("model", model, role="the reward model")],
        fix="Lower rm.lr, keep rm.grad_clip > 0, or use model.dtype=float32 / bfloat16 instead "
        "of float16.",
    )
    resumed = checkpoints.resume(cfg.trainer.resume)
    if resumed is not None:
        state = resumed.state
        if state.history is None:
            raise UserError(
                f"trainer.resume: {resumed.path} is not a reward-model training checkpoint (no "
                "history); resume it with the command that wrote it"
            )
        say(f"resumed the reward model from {resumed.path} (step {state.step})")
    else:
        state = RunState(step=0, history=[], val_accuracy_before=held_out())
        say(f"held-out pairwise accuracy before training: {state.val_accuracy_before}")
    history = state.history
    log_every = max(1, rm.steps // 20)
    for step in range(state.step + 1, rm.steps + 1):
        batch = train.select(batch_indices(step, len(train), rm.batch_size, cfg.trainer.seed))
        metrics = bradley_terry_step(
            model.train_micro_batches, mesh, batch.share(mesh), num_pairs=rm.batch_size, **sizes
        )
        entry = {"step": step, **{k: metrics[k] for k in ("loss", "accuracy", "grad_norm", "lr")}}
        if rm.val_freq and step % rm.val_freq == 0 and step != rm.steps:
            entry["val_accuracy"] = held_out()
        history.append(entry)
        state.step = step
        if step % log_every == 0 or step == rm.steps or "val_accuracy" in entry:
            shown = ", ".join(
                f"{k} {v:.4g}" for k, v in entry.items() if k != "step" and v is not None
            )
            say(f"rm step {step}/{rm.steps}: {shown} ({time.perf_counter() - start:.1f} s)")
        if rm.save_freq and step % rm.save_freq == 0:
            checkpoints.save(step, state)
    after = held_out()
    say(f"held-out pairwise accuracy after training: {after}")
    out_dir = Path(rm.out_dir)
    with replacing_folder(out_dir, mesh.rank) as staging:  # a crash leaves only the .tmp folder
        save_hf_checkpoint(model.models, mesh, staging, model.hf_config, tokenizer_dir=init_dir)
    report = RewardModelReport(
        out_dir=str(out_dir),
        steps=rm.steps,
        train_pairs=len(train),
        val_pairs=len(val) if val else 0,
        dropped_too_long=dropped + val_dropped,
        val_accuracy_before=state.val_accuracy_before,
        val_accuracy_after=after,
        final_loss=history[-1]["loss"] if history else None,
        seconds=time.perf_counter() - start,
        history=history,
    )
    if mesh.rank == 0:
        report_file = Path(cfg.trainer.output_dir) / REPORT_FILE
        report_file.write_text(json.dumps(asdict(report), indent=2))
        say(f"wrote the reward model {out_dir} and {report_file}")
    _barrier()
    return report
