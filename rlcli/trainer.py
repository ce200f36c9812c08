"""The RL trainer: every rank runs the same code (SPMD under torchrun).

``rl_step`` is the whole algorithm on one screen, one timed phase per call, in the order a batch
travels: rollout -> reward -> distribute -> old_log_prob -> ref -> values -> adv ->
update_critic -> update -> sync (values and update_critic only with PPO's critic; during
``trainer.critic_warmup`` steps only the critic learns).
``Trainer.fit`` repeats it, evaluates on held-out prompts and commits checkpoints. The trainer is
built from the config by ``rlcli.build.build_trainer``.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from parallel.mesh import Mesh
from rlcli.actor_update import (
    kl_metric_kind,
    logprob_agreement,
    logprob_metrics,
    old_log_probs_from_update,
    update_actor,
)
from rlcli.advantages import KLController, compute_advantages
from rlcli.batch import collate, take_dp_share
from rlcli.config import RLConfig
from rlcli.critic import MegatronCritic, update_critic, value_metrics
from rlcli.data import PromptDataset, PromptLoader
from rlcli.dp_stats import DataParallelStats
from rlcli.errors import UserError
from rlcli.machine import device_summary, format_duration, seconds_since_process_start
from rlcli.metrics import MetricsLogger, Timer
from rlcli.policy import MegatronPolicy
from rlcli.rewards import RewardManager
from rlcli.rollout.base import RolloutEngine
from rlcli.run_checkpoint import CheckpointManager, save_run
from rlcli.sampling import ReplicaInfo, collect_rollouts, evaluate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A file whose appearance asks the run to stop after the current step with a checkpoint (the
# sbatch script creates it when Slurm warns of preemption or the time limit).
STOP_FILE_ENV = "RLCLI_STOP_FILE"


@dataclass
class Trainer:
    cfg: RLConfig
    mesh: Mesh
    tokenizer: PreTrainedTokenizerBase  # pad / eos ids, decoding responses for rewards
    model_dir: str  # the HF directory the run starts from (after any SFT warm start)
    actor: MegatronPolicy
    reference: MegatronPolicy | None  # frozen; only when a KL term needs it
    engine: RolloutEngine
    replica: ReplicaInfo
    rewards: RewardManager
    loader: PromptLoader
    val_data: PromptDataset | None
    kl_ctrl: KLController
    checkpoints: CheckpointManager
    logger: MetricsLogger | None
    total_steps: int
    critic: MegatronCritic | None = None  # PPO's value model (algorithm.adv_estimator=gae)
    step: int = 0
    resumed_from: int | None = None  # the checkpoint step this run continues from
    stats: DataParallelStats = field(init=False)

    def __post_init__(self) -> None:
        self.stats = DataParallelStats(self.mesh)
        # Warmup, decay and total are counted in RL steps: fit() steps the schedule once per
        # step, whatever the number of mini-batches (optimizer steps) in it.
        self.actor.schedule_per_update = False

    def fit(self) -> dict[str, float]:
        """Train to ``total_steps``; returns the last held-out metrics (and ``before/...``).

        SIGTERM / SIGUSR1 (or the file named by ``RLCLI_STOP_FILE`` appearing) end the run
        after the current step with a checkpoint and exit code 0; the same command resumes.
        """
        stop = StopRequest()
        try:
            return self._fit(stop)
        finally:
            stop.uninstall()
            if self.logger is not None:
                self.logger.close()
            self.rewards.close()
            self.engine.close()

    def _fit(self, stop: StopRequest) -> dict[str, float]:
        cfg = self.cfg
        before: dict[str, float] = {}
        # The engine starts with dummy (or the HF directory's) weights: the first sync both
        # gives it the policy's weights (a resumed checkpoint's too) and proves the path.
        sync_rollout_weights(self)
        if self.resumed_from is not None:
            say(self.mesh, f"resumed from step {self.resumed_from}")
        elif cfg.trainer.val_before_train:
            before = self.evaluate()
            self.log(0, before)
            accuracy = before.get("val/reward/accuracy", float("nan"))
            say(self.mesh, f"validation before RL: accuracy {accuracy:.3f}")
        after: dict[str, float] = {}
        nonfinite_in_a_row = 0
        while self.step < self.total_steps:
            self.step += 1
            dropped = self.actor.nonfinite_updates
            metrics = rl_step(self)
            self.actor.advance_schedule()  # once per RL step (skipped or not)
            nonfinite = self.actor.nonfinite_updates - dropped  # equal on all ranks
            metrics["actor/nonfinite_steps"] = float(nonfinite)
            metrics.update({"data/epoch": self.loader.epoch, "data/position": self.loader.position})
            last = self.step == self.total_steps
            if (cfg.trainer.val_freq and self.step % cfg.trainer.val_freq == 0) or last:
                after = self.evaluate()
                metrics.update(after)
            self.log(self.step, metrics)
            check_logprob_diff(self, metrics)
            nonfinite_in_a_row = nonfinite_in_a_row + 1 if nonfinite else 0
            if nonfinite:
                self.stop_if_nonfinite(nonfinite_in_a_row)
            stopping = stop.agreed(self.actor.models)
            periodic = cfg.checkpoint.save_freq and self.step % cfg.checkpoint.save_freq == 0
            if periodic or last or stopping:
                self.save()
            if stopping and not last:
                say(
                    self.mesh,
                    f"stopped after step {self.step} ({stop.reason}); checkpoint saved: run the "
                    "same command again to continue from here",
                )
                return {}
        if before and after:
            say(
                self.mesh,
                "held-out accuracy before RL {:.3f} -> after {:.3f} ({} steps); {} since start, "
                "{}".format(
                    before["val/reward/accuracy"],
                    after["val/reward/accuracy"],
                    self.step,
                    format_duration(seconds_since_process_start()),
                    device_summary(),
                ),
            )
        return {**{f"before/{k}": v for k, v in before.items()}, **after}

    def stop_if_nonfinite(self, in_a_row: int) -> None:
        limit = self.cfg.trainer.max_nonfinite_steps
        say(self.mesh, f"step {self.step}: non-finite loss or gradient; the update was dropped")
        if in_a_row >= limit:
            latest = self.checkpoints.latest_dir()
            raise UserError(
                f"step {self.step}: {in_a_row} steps in a row had a non-finite loss or gradient "
                f"and were not applied (trainer.max_nonfinite_steps={limit}); the newest good "
                f"checkpoint is {latest or 'none'}. Likely causes: actor.lr too high, "
                "actor.grad_clip=0 (no clipping), algorithm.epsilon=0 with groups whose rewards "
                "are all equal, or overflow in model.dtype=float16 / bfloat16."
            )

    def evaluate(self) -> dict[str, float]:
        if self.val_data is None:
            return {}
        return evaluate(
            self.cfg,
            self.engine,
            self.replica,
            self.val_data,
            self.rewards,
            self.tokenizer,
            self.step,
        )

    def save(self) -> None:
        state = {
            "step": self.step,
            "loader": self.loader.state_dict(),
            "kl_coef": float(self.kl_ctrl.value),
            "model_dir": self.model_dir,
        }
        save_run(
            self.checkpoints,
            self.step,
            self.actor,
            self.model_dir,
            state,
            self.cfg.checkpoint.save_optimizer,
            critic=self.critic,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.logger is not None:
            self.logger.log(step, metrics)


def rl_step(t: Trainer) -> dict[str, float]:
    """One training step: each phase one call, timed, named after what it does."""
    cfg, timer = t.cfg, Timer()
    mbs, temperature = cfg.actor.micro_batch_size, cfg.rollout.temperature or 1.0
    # The no-grad passes: their own token budget, else the training one.
    forward_tokens = cfg.actor.max_tokens_per_forward or cfg.actor.max_tokens_per_micro_batch
    moved = {"offload": 0, "onload": 0}
    with timer("step"):
        with timer("offload"):  # the engine generates in the device memory the actor frees
            moved["offload"] += t.actor.offload(**actor_offload(cfg)).bytes
            if t.critic is not None:  # the critic follows the actor's offload settings
                moved["offload"] += t.critic.offload(**actor_offload(cfg)).bytes
        # rollout + reward (timed inside): every rank ends with ALL scored samples, exchanged once
        samples, metrics = collect_rollouts(
            cfg, t.engine, t.replica, t.loader, t.rewards, t.tokenizer, t.step, timer
        )
        with timer("distribute"):  # this DP rank's whole groups; from here on nothing moves
            mine, fewest_groups = take_dp_share(samples, t.mesh.dp, t.mesh.dp_rank)
            if fewest_groups == 0:  # DAPO kept fewer informative groups than there are DP ranks
                t.actor.onload(params=True, grads=True, optimizer=True)
                if t.critic is not None:
                    t.critic.onload(params=True, grads=True, optimizer=True)
                return {**metrics, **timer.metrics(), "actor/skipped_update": 1.0}
            batch = collate(mine, t.tokenizer.pad_token_id)
        with timer("onload"):
            moved["onload"] += t.actor.onload(params=True).bytes
        if cfg.actor.old_log_prob_source == "engine":
            batch["old_log_probs"] = batch["engine_logprobs"]
        elif not old_log_probs_from_update(cfg):  # else: the update forward's own, detached
            with timer("old_log_prob"):
                batch["old_log_probs"] = t.actor.log_probs(batch, mbs, temperature, forward_tokens)
        if t.reference is not None:
            with timer("ref"):
                t.reference.onload(params=True)
                batch["ref_log_probs"] = t.reference.log_probs(
                    batch, mbs, temperature, forward_tokens
                )
                if cfg.ref.offload:
                    t.reference.offload(params=True)
        if t.critic is not None:
            with timer("onload"):
                moved["onload"] += t.critic.onload(params=True).bytes
            with timer("values"):
                batch["values"] = t.critic.forward_values(batch, cfg.critic.micro_batch_size)
        with timer("adv"):
            metrics.update(compute_advantages(batch, cfg, t.kl_ctrl, t.stats))
        if t.critic is not None:
            metrics.update(value_metrics(batch, t.stats))
            with timer("onload"):
                moved["onload"] += t.critic.onload(grads=True, optimizer=True).bytes
            with timer("update_critic"):
                metrics.update(update_critic(t.critic, batch, cfg, t.mesh, fewest_groups))
            with timer("offload"):  # the actor's update gets the memory the critic held
                moved["offload"] += t.critic.offload(**actor_offload(cfg)).bytes
        with timer("onload"):
            moved["onload"] += t.actor.onload(grads=True, optimizer=True).bytes
        if t.critic is not None and t.step <= cfg.trainer.critic_warmup:  # the critic learns first
            metrics["actor/skipped_update"] = 1.0
            if t.engine.needs_weight_sync:  # a level-2 sleep discarded the (unchanged) weights
                with timer("sync"):
                    metrics.update(sync_rollout_weights(t))
        else:
            with timer("update"):
                metrics.update(update_actor(t.actor, batch, cfg, t.mesh, fewest_groups))
            with timer("sync"):
                metrics.update(sync_rollout_weights(t))
    metrics.update(batch_metrics(batch, t))
    metrics.update(timer.metrics())
    metrics.update({f"{kind}/bytes_gb": nbytes / 1e9 for kind, nbytes in moved.items()})
    metrics["perf/tokens_per_s"] = metrics.pop("perf/tokens") / max(metrics["timing/step"], 1e-9)
    metrics["perf/peak_memory_gb"] = peak_memory_gb()
    return metrics


def actor_offload(cfg: RLConfig) -> dict[str, bool]:
    """What of the actor leaves the device while the engine generates (``actor.offload_*``)."""
    a = cfg.actor
    return {"params": a.offload_params, "grads": a.offload_grads, "optimizer": a.offload_optimizer}


def check_logprob_diff(t: Trainer, metrics: dict[str, float]) -> None:
    """``rollout.max_logprob_diff``: the trainer and the engine must agree on the sampled tokens'
    log-probs (a broken weight sync trains on garbage otherwise)."""
    r = t.cfg.rollout
    diff = metrics.get("rollout/logprob_diff_mean")
    if diff is None or diff <= r.max_logprob_diff:
        return
    message = (
        f"step {t.step}: the trainer's and the engine's log-probs of the sampled tokens differ "
        f"by {diff:.4g} per token on average (rollout.max_logprob_diff={r.max_logprob_diff}): "
        "the engine may not hold the trained weights (weight sync), or model.dtype / "
        "rollout.engine settings disagree"
    )
    if r.logprob_diff_action == "stop":
        raise UserError(message + " (rollout.logprob_diff_action=stop).")
    say(t.mesh, "warning: " + message + ".")


class StopRequest:
    """SIGTERM / SIGUSR1 (Slurm preemption, ``scancel``) or a stop file ask the run to end after
    the current step with a checkpoint. ``agreed`` is a collective: every rank stops together."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.reason: str | None = None
        self.stop_file = os.environ.get(STOP_FILE_ENV)
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for number in self.SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)

    def _handle(self, number: int, frame: Any) -> None:
        if self.reason is not None:  # asked twice: stop now
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
        self.reason = signal.Signals(number).name
        print(f"[rlcli] {self.reason}: stopping after this step", flush=True)

    def agreed(self, models: list[torch.nn.Module]) -> bool:
        if self.reason is None and self.stop_file and os.path.exists(self.stop_file):
            self.reason = f"stop file {self.stop_file}"
        wanted = torch.tensor([1.0 if self.reason else 0.0])
        if dist.is_available() and dist.is_initialized():
            wanted = wanted.to(next(models[0].parameters()).device)
            dist.all_reduce(wanted, op=dist.ReduceOp.MAX)
        if wanted.item() > 0 and self.reason is None:
            self.reason = "another rank was asked to stop"
        return wanted.item() > 0

    def uninstall(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)


def sync_rollout_weights(t: Trainer) -> dict[str, float]:
    """Stream the actor's new weights into the engine's layout (``parallel.reshard``)."""
    from parallel.reshard import sync_weights

    stats = sync_weights(t.actor.models, t.mesh, t.engine, t.cfg.rollout.sync_bucket_mb)
    return {
        "sync/bytes_gb": stats.bytes / 1e9,
        "sync/gbps": stats.gbps,
        "sync/buckets": float(stats.num_buckets),
    }


def batch_metrics(batch: dict[str, torch.Tensor], t: Trainer) -> dict[str, float]:
    """Whole-batch metrics from this rank's share: the token count and, when the old log-probs
    came from a separate actor pass, trainer-vs-engine log-prob agreement on the sampled tokens
    and KL to the reference (otherwise the update reported those from its own forward)."""
    metrics = {"perf/tokens": t.stats.sum(batch["attention_mask"].sum().double()).item()}
    if t.cfg.actor.old_log_prob_source == "actor" and "old_log_probs" in batch:
        sums, largest = logprob_agreement(
            batch["old_log_probs"],
            batch["engine_logprobs"],
            batch.get("ref_log_probs"),
            batch["response_mask"],
            kl_metric_kind(t.cfg),
        )
        metrics.update(logprob_metrics(sums, largest, t.stats, t.reference is not None))
    return metrics


def peak_memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def say(mesh: Mesh, message: str) -> None:
    if mesh.rank == 0:
        print(f"[rlcli] {message}", flush=True)
