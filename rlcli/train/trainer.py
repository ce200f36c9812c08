"""The RL trainer: every rank runs the same code (SPMD under torchrun).

``rl_step`` is the whole algorithm on one screen, one phase per call, in the order a batch
travels: rollout (gen + reward) -> reward_model / judge -> DAPO's filter -> distribute ->
old_log_prob -> ref -> teacher -> values -> adv -> update_critic -> update -> sync
(reward_model / judge only with model rewards, ``rlcli.reward_models.model_rewards``; the filter
only with ``algorithm.dynamic_sampling``, ``rlcli.rollout.dynamic_sampling``; teacher only with
on-policy distillation, ``distill.*``, before distribute when the teacher is an engine; values
and update_critic only with PPO's critic; during ``trainer.critic_warmup`` steps only the critic
learns). Each phase is entered through ``rlcli.model.residency.StepPhases``, which first gives it
the device residency its row of the plan declares, then times it (the filter moves nothing and
is not timed). Where the samples come from and the weights go is the rollout placement's
(``rlcli.rollout.placement``: colocated engines, or engines on their own ranks generating
ahead). ``Trainer.fit`` repeats the step, evaluates on held-out prompts and commits checkpoints.
The trainer is built from the config by ``rlcli.train.build.build_trainer``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from parallel.mesh import Mesh
from parallel.moe import router_load_metrics
from rlcli.config.schema import RLConfig
from rlcli.console import say
from rlcli.data import PromptLoader
from rlcli.errors import UserError
from rlcli.machine import device_summary, format_duration, seconds_since_process_start
from rlcli.model.dp_stats import DataParallelStats
from rlcli.model.residency import Residency, StepPhases, residency_plan
from rlcli.model.trained_model import LoraReference, TrainedModel
from rlcli.process_lifetime import StopRequest, leave_for_a_restart, peer_lost
from rlcli.reward_models.model_rewards import ModelRewards
from rlcli.rollout.batch import RolloutBatch, collate, take_dp_share
from rlcli.rollout.dynamic_sampling import keep_informative_groups
from rlcli.rollout.placement import Rollouts
from rlcli.run.metrics import METRICS_FILE_NAME, TENSORBOARD_DIR_NAME, MetricsLogger
from rlcli.run.state import RunState
from rlcli.run.system_metrics import SystemMonitor, system_metrics
from rlcli.train.actor_update import agreement_of_actor_pass, old_log_prob_pass, update_actor
from rlcli.train.advantages import KLController, compute_advantages
from rlcli.train.critic import update_critic, value_metrics
from rlcli.train.save_resume import RunCheckpoints
from rlcli.train.teacher import TeacherEngine, teacher_pass

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class Trainer:
    cfg: RLConfig
    mesh: Mesh
    tokenizer: PreTrainedTokenizerBase  # pad / eos ids, decoding responses for rewards
    model_dir: str  # the HF directory the run starts from (after any SFT warm start)
    actor: TrainedModel
    # frozen; only when a KL term needs it (a LoRA actor's: the actor with its adapters off)
    reference: TrainedModel | LoraReference | None
    rollouts: Rollouts  # where the samples come from and the new weights go
    loader: PromptLoader  # the prompts the trainer has consumed (what a checkpoint resumes)
    kl_ctrl: KLController
    checkpoints: RunCheckpoints  # the actor's (and critic's) save / resume
    logger: MetricsLogger | None
    total_steps: int
    critic: TrainedModel | None = None  # PPO's value model (algorithm.adv_estimator=gae)
    # on-policy distillation's frozen teacher (distill.*): on Megatron, or on an engine
    teacher: TrainedModel | None = None
    teacher_engine: TeacherEngine | None = None
    model_rewards: ModelRewards | None = None  # reward.model / reward.judge
    settings: dict[str, Any] | None = None  # the config as given (RunInputs.settings)
    step: int = 0
    resumed_from: int | None = None  # the checkpoint step this run continues from
    stats: DataParallelStats = field(init=False)
    residency: Residency = field(init=False)
    system: SystemMonitor = field(init=False)  # system/* each step

    def __post_init__(self) -> None:
        self.stats = DataParallelStats(self.mesh)
        self.system = SystemMonitor()
        # A LoRA actor's reference is the actor itself: its residency is the actor's.
        reference = self.reference if isinstance(self.reference, TrainedModel) else None
        models = {
            "actor": self.actor,
            "reference": reference,
            "teacher": self.teacher,
            "critic": self.critic,
        }
        if self.model_rewards is not None:
            models["reward_model"] = self.model_rewards.reward_model
        self.residency = Residency(residency_plan(self.cfg), models)
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
        except RuntimeError as error:
            if peer_lost(error):
                leave_for_a_restart(error, self.logger.close if self.logger else None)
            raise
        finally:
            stop.uninstall()
            if self.logger is not None:
                self.logger.close()
            self.rollouts.close()
            if self.model_rewards is not None:
                self.model_rewards.close()
            if self.teacher_engine is not None:
                self.teacher_engine.close()

    def _fit(self, stop: StopRequest) -> dict[str, float]:
        cfg = self.cfg
        before: dict[str, float] = {}
        # The engine starts with dummy (or the HF directory's) weights: the first sync both
        # gives it the policy's weights (a resumed checkpoint's too) and proves the path.
        self.rollouts.start(self.step, self.loader, self.validates_at)
        sync_rollout_weights(self)
        if self.resumed_from is not None:
            say(self.mesh, f"resumed from step {self.resumed_from}")
            stop.kept = f"the checkpoint of step {self.resumed_from}"
        elif self.validates_at(self.step):
            before = self.evaluate()
            self.log(0, before)
            accuracy = before.get("val/reward/accuracy", float("nan"))
            say(self.mesh, f"validation before RL: accuracy {accuracy:.3f}")
        after: dict[str, float] = {}
        nonfinite_in_a_row = skipped_in_a_row = 0
        while self.step < self.total_steps:
            self.step += 1
            dropped = self.actor.nonfinite_updates
            metrics = rl_step(self)
            self.actor.advance_schedule()  # once per RL step (skipped or not)
            nonfinite = self.actor.nonfinite_updates - dropped  # equal on all ranks
            metrics["actor/nonfinite_steps"] = float(nonfinite)
            metrics.update({"data/epoch": self.loader.epoch, "data/position": self.loader.position})
            last = self.step == self.total_steps
            if self.validates_at(self.step):
                after = self.evaluate()
                metrics.update(after)
            self.log(self.step, metrics)
            check_logprob_diff(self, metrics)
            nonfinite_in_a_row = nonfinite_in_a_row + 1 if nonfinite else 0
            if nonfinite:
                self.stop_if_nonfinite(nonfinite_in_a_row)
            skipped = "dapo/kept_groups" in metrics and metrics.get("actor/skipped_update") == 1.0
            skipped_in_a_row = skipped_in_a_row + 1 if skipped else 0
            if skipped:
                self.report_skipped_update(metrics, skipped_in_a_row)
            stopping = stop.agreed(self.actor.models, self.rollouts.stop_requested())
            periodic = cfg.checkpoint.save_freq and self.step % cfg.checkpoint.save_freq == 0
            if periodic or last or stopping:
                self.save()
                stop.kept = f"the checkpoint of step {self.step}"
            if stopping and not last:
                say(
                    self.mesh,
                    f"stopped after step {self.step} ({stop.reason}); checkpoint saved: run the "
                    "same command again to continue from here",
                )
                return {}
        self.say_run_end(before, after)
        return {**{f"before/{k}": v for k, v in before.items()}, **after}

    def say_run_end(self, before: dict[str, float], after: dict[str, float]) -> None:
        """The run's last lines: what it did, how well, how long, and where everything went."""
        start = self.resumed_from or 0
        done = f"done: step {self.step} of {self.total_steps}"
        if start:
            done += f" ({self.step - start} steps since the resume from step {start})"
        say(
            self.mesh,
            f"{done}; {format_duration(seconds_since_process_start())} since start, "
            f"{device_summary()}",
        )
        key = "val/reward/accuracy"
        if key in after:
            was = f"before RL {before[key]:.3f} -> " if key in before else ""
            say(self.mesh, f"held-out accuracy {was}after {after[key]:.3f} ({self.step} steps)")
        latest = self.checkpoints.manager.latest_dir()
        say(self.mesh, f"checkpoint: {latest or 'none saved'}")
        out = Path(self.cfg.trainer.output_dir)
        backends = self.cfg.logging.backends
        if "jsonl" in backends:
            say(self.mesh, f"metrics: {out / METRICS_FILE_NAME} (rlcli plot {out} draws them)")
        if "tensorboard" in backends:
            say(self.mesh, f"TensorBoard: tensorboard --logdir {out / TENSORBOARD_DIR_NAME}")

    def stop_if_nonfinite(self, in_a_row: int) -> None:
        limit = self.cfg.trainer.max_nonfinite_steps
        say(self.mesh, f"step {self.step}: non-finite loss or gradient; the update was dropped")
        if in_a_row >= limit:
            latest = self.checkpoints.manager.latest_dir()
            raise UserError(
                f"step {self.step}: {in_a_row} steps in a row had a non-finite loss or gradient "
                f"and were not applied (trainer.max_nonfinite_steps={limit}); the newest good "
                f"checkpoint is {latest or 'none'}. Likely causes: actor.lr too high, "
                "actor.grad_clip=0 (no clipping), algorithm.epsilon=0 with groups whose rewards "
                "are all equal, or overflow in model.dtype=float16 / bfloat16."
            )

    def report_skipped_update(self, metrics: dict[str, float], in_a_row: int) -> None:
        """A DAPO step that kept too few groups to give every data-parallel rank one."""
        kept, drawn = int(metrics["dapo/kept_groups"]), int(metrics["dapo/drawn_groups"])
        why = (
            f"DAPO's filter kept {kept} of the {drawn} groups drawn (those whose "
            f"{self.cfg.algorithm.dynamic_sampling.metric} varies), fewer than the "
            f"{self.mesh.dp} data-parallel ranks"
        )
        metric = self.cfg.algorithm.dynamic_sampling.metric
        say(
            self.mesh,
            f"step {self.step}: no update: DAPO kept {kept}/{drawn} groups (varying {metric}) "
            f"< {self.mesh.dp} DP ranks; {in_a_row} in a row",
        )
        limit = self.cfg.trainer.max_skipped_steps
        if limit and in_a_row >= limit:
            raise UserError(
                f"step {self.step}: {in_a_row} steps in a row applied no update "
                f"(trainer.max_skipped_steps={limit}): {why}. When every group's reward is the "
                "same the policy gets no signal: check that the reward (reward.fn) tells good "
                "responses from bad ones, or raise algorithm.dynamic_sampling.max_gen_batches to "
                "draw more groups per step."
            )

    def validates_at(self, step: int) -> bool:
        """Whether the weights after ``step`` get a held-out evaluation: before RL
        (``trainer.val_before_train``, not on a resume), every ``trainer.val_freq`` steps, and
        at the last step."""
        t = self.cfg.trainer
        if step == (self.resumed_from or 0):
            return self.resumed_from is None and t.val_before_train
        return bool(t.val_freq and step % t.val_freq == 0) or step == self.total_steps

    def evaluate(self) -> dict[str, float]:
        return self.rollouts.evaluate(self.step)

    def save(self) -> None:
        self.residency.enter("checkpoint")
        state = RunState(
            step=self.step,
            loader=self.loader.state_dict(),
            kl_coef=float(self.kl_ctrl.value),
            # A LoRA run saves only the adapters: resume and export rebuild the base from it.
            model_dir=self.model_dir,
            model_rewards=None if self.model_rewards is None else self.model_rewards.state_dict(),
            settings=self.settings,
        )
        self.checkpoints.save(self.step, state)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.logger is not None:
            self.logger.log(step, metrics)


def rl_step(t: Trainer) -> dict[str, float]:
    """One training step: each phase one call, named after what it does."""
    phases = StepPhases(t.residency)
    with phases.step():
        # gen + reward (timed inside): every rank ends with ALL scored samples, exchanged once
        with phases("rollout", timed=False):
            samples, metrics = t.rollouts.collect(t.loader, t.step, phases.timer)
        if t.model_rewards is not None:  # reward model / judge phases
            metrics.update(t.model_rewards.score(samples, phases, t.step))
        if t.cfg.algorithm.dynamic_sampling.enabled:  # DAPO: the groups whose reward varies
            samples, kept = keep_informative_groups(
                samples, t.cfg.algorithm.dynamic_sampling, t.cfg.data.train_batch_size
            )
            metrics.update(kept)
        if t.teacher_engine is not None:  # distillation's teacher on an engine: every sample
            with phases("teacher"):
                t.teacher_engine.score(samples)
        with phases("distribute"):  # this DP rank's whole groups; from here on nothing moves
            mine, fewest_groups = take_dp_share(samples, t.mesh.dp, t.mesh.dp_rank)
            batch = collate(mine, t.tokenizer.pad_token_id) if fewest_groups else None
        if batch is None:  # DAPO kept fewer informative groups than there are DP ranks
            metrics["actor/skipped_update"] = 1.0
        else:
            metrics.update(learn(t, batch, fewest_groups, phases))
    metrics.update(phases.metrics())
    tokens = float(sum(s.num_tokens for s in samples))  # every rank holds every sample
    metrics["perf/tokens_per_s"] = tokens / max(metrics["timing/step"], 1e-9)
    metrics["perf/peak_memory_gb"] = peak_memory_gb()
    metrics.update(system_metrics(t.system, t.stats.max, t.stats.sum, t.mesh.dp))
    return metrics


def learn(t: Trainer, batch: RolloutBatch, fewest_groups: int, phases: StepPhases) -> dict:
    """The step's phases after the rollout, on this DP rank's whole groups."""
    cfg, temperature, metrics = t.cfg, t.cfg.rollout.temperature or 1.0, {}
    old_log_probs = cfg.old_log_prob_plan
    if old_log_probs == "engine":
        batch.old_log_probs = batch.engine_log_probs
    elif old_log_probs == "actor_pass":
        with phases("old_log_prob"):
            metrics.update(old_log_prob_pass(t.actor, batch, cfg, temperature))
    if t.reference is not None:
        with phases("ref"):
            batch.ref_log_probs = t.reference.forward(batch, temperature)
    if t.teacher is not None:
        with phases("teacher"):
            teacher_pass(t.teacher, batch, cfg.distill, temperature)
    if t.critic is not None:
        with phases("values"):
            batch.values = t.critic.forward(batch)
    with phases("adv"):
        metrics.update(compute_advantages(batch, cfg, t.kl_ctrl, t.stats))
    if t.critic is not None:
        metrics.update(value_metrics(batch, t.stats))
        with phases("update_critic"):
            metrics.update(update_critic(t.critic, batch, cfg, fewest_groups))
            metrics.update(router_load_metrics(t.critic.models, t.mesh, prefix="critic_router"))
    actor_learns = t.critic is None or t.step > cfg.trainer.critic_warmup
    if actor_learns:
        with phases("update"):
            metrics.update(update_actor(t.actor, batch, cfg, fewest_groups))
            metrics.update(router_load_metrics(t.actor.models, t.mesh))  # MoE models only
    else:  # PPO's critic warmup: the critic learns first
        metrics["actor/skipped_update"] = 1.0
    if actor_learns or t.rollouts.needs_weight_sync:
        with phases("sync"):
            metrics.update(sync_rollout_weights(t))
    if old_log_probs == "actor_pass":  # else the update's first forward measured it
        metrics.update(agreement_of_actor_pass(batch, cfg, t.stats))
    return metrics


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


def sync_rollout_weights(t: Trainer) -> dict[str, float]:
    """Stream the actor's weights after this step into the engines' layout."""
    return t.rollouts.sync_weights(t.actor.models, t.mesh, t.step)


def peak_memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
