"""Which model state sits on the device in each phase of the step: the residency plan, declared
once from the config, and the one helper that makes it so, timing and counting what moves.

A row of the plan is a phase; for each model (``actor``, ``reference``, ``teacher``, ``critic``,
``reward_model``) it names the
kinds of state (``params``, ``grads``, ``optimizer``) the phase needs ON the device, and those it
must hand back (OFF: the memory goes to something else, such as the engine's KV cache while it
generates). What a row does not name stays where the previous phase left it, so nothing moves
twice: the actor's offloaded weights come back for its first forward of the step and stay until
the next rollout.

    rollout        actor, critic: OFF their ``*.offload_*`` kinds; reference: OFF if ref.offload
    reward_model   reward_model: ON params (reward.model.*: scores the samples)
    judge          (the judge is an engine: it wakes for this phase and sleeps after it)
    distribute     (nothing moves)
    old_log_prob   actor: ON params
    ref            reference: ON params
    teacher        teacher: ON params (on-policy distillation's, ``distill.*``)
    values         critic: ON params
    adv            (nothing moves)
    update_critic  critic: ON params, grads, optimizer
    update         actor: ON params, grads, optimizer; critic: OFF its offload kinds
    sync           actor: ON params
    checkpoint     actor, critic: ON everything (a save reads it all)
    (the reference is OFF again in every phase that moves something but ``ref`` when
    ref.offload, the teacher in every such phase but ``teacher`` when distill.offload, and the
    reward model in every such phase but ``reward_model`` when reward.model.offload)

The phases are a closed set, ``Phase``: a plan row or a phase entered under any other name is an
error, never a phase that silently moves nothing.

With ``rollout.placement=separate`` the engines run on ranks of their own: the rollout row is
empty (nothing leaves the trainer's device for them), and a rollout rank holds no model at all.

With LoRA (``actor.lora.enable``) there is no reference model: the reference is the actor with
its adapters switched off, so the ``ref`` row asks for the actor's params instead.

A phase the step skips is not entered, so a skipped update (PPO's critic warmup, DAPO keeping too
few groups) moves no gradient or optimizer state. Adding a phase is one member of ``Phase``, its row
here and one call in the step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from rlcli.run.metrics import Timer

if TYPE_CHECKING:
    from rlcli.config.schema import RLConfig, TrainedModelConfig
    from rlcli.model.trained_model import TrainedModel

KINDS = ("params", "grads", "optimizer")


class Phase(str, Enum):
    """The phases of a step, in the order a batch travels (``checkpoint``: a save after it).
    Equal to their names as strings; ``Phase("updte")`` raises."""

    rollout = "rollout"
    reward_model = "reward_model"
    judge = "judge"
    distribute = "distribute"
    old_log_prob = "old_log_prob"
    ref = "ref"
    teacher = "teacher"
    values = "values"
    adv = "adv"
    update_critic = "update_critic"
    update = "update"
    sync = "sync"
    checkpoint = "checkpoint"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def named(cls, name: str | Phase) -> Phase:
        """The phase called ``name``; ValueError naming the phases otherwise."""
        try:
            return cls(name)
        except ValueError:
            raise ValueError(
                f"unknown step phase {name!r}; the phases are: {', '.join(p.value for p in cls)} "
                "(rlcli.model.residency.Phase)"
            ) from None


@dataclass(frozen=True)
class Need:
    """What one phase needs of one model: kinds ON the device, kinds OFF it."""

    on: frozenset[str] = frozenset()
    off: frozenset[str] = frozenset()


ResidencyPlan = dict[Phase, dict[str, Need]]  # phase -> model name -> need


def offloaded_kinds(section: TrainedModelConfig) -> frozenset[str]:
    """The kinds a trained model's ``offload_*`` keys send to the host while the engine runs."""
    wanted = (section.offload_params, section.offload_grads, section.offload_optimizer)
    return frozenset(kind for kind, offload in zip(KINDS, wanted, strict=True) if offload)


def residency_plan(cfg: RLConfig) -> ResidencyPlan:
    """The plan of the module docstring for this config (rows for absent models are ignored)."""
    everything = frozenset(KINDS)
    actor_off, critic_off = offloaded_kinds(cfg.actor), offloaded_kinds(cfg.critic)
    reference_off = frozenset({"params"} if cfg.ref.offload else ())
    reward_model_off = frozenset({"params"} if cfg.reward.model.offload else ())
    teacher_off = frozenset({"params"} if cfg.distill.offload else ())
    reference = "actor" if cfg.actor.lora.enable else "reference"  # LoRA: the actor, adapters off
    plan: ResidencyPlan = {
        Phase.rollout: {"actor": Need(off=actor_off), "critic": Need(off=critic_off)},
        Phase.reward_model: {"reward_model": Need(on=frozenset({"params"}))},
        Phase.judge: {},
        Phase.old_log_prob: {"actor": Need(on=frozenset({"params"}))},
        Phase.ref: {reference: Need(on=frozenset({"params"}))},
        Phase.teacher: {"teacher": Need(on=frozenset({"params"}))},
        Phase.values: {"critic": Need(on=frozenset({"params"}))},
        Phase.update_critic: {"critic": Need(on=everything)},
        Phase.update: {"actor": Need(on=everything), "critic": Need(off=critic_off)},
        Phase.sync: {"actor": Need(on=frozenset({"params"}))},
        Phase.checkpoint: {"actor": Need(on=everything), "critic": Need(on=everything)},
    }
    if cfg.rollout.placement == "separate":
        plan[Phase.rollout] = {}
    for phase, row in plan.items():
        if phase != Phase.ref:
            row["reference"] = Need(off=reference_off)
        if phase != Phase.reward_model:
            row["reward_model"] = Need(off=reward_model_off)
        if phase != Phase.teacher:
            row["teacher"] = Need(off=teacher_off)
    return plan


@dataclass
class Moved:
    """What entering phases moved: bytes and seconds each way."""

    offload_bytes: int = 0
    onload_bytes: int = 0
    offload_seconds: float = 0.0
    onload_seconds: float = 0.0

    def add(self, other: Moved) -> None:
        self.offload_bytes += other.offload_bytes
        self.onload_bytes += other.onload_bytes
        self.offload_seconds += other.offload_seconds
        self.onload_seconds += other.onload_seconds


class Residency:
    """Applies a plan to the run's models: ``enter(phase)`` moves what the phase's row asks
    and returns what moved. Every rank enters the same phases in the same order."""

    def __init__(self, plan: ResidencyPlan, models: Mapping[str, TrainedModel | None]) -> None:
        rows = {Phase.named(phase): row for phase, row in plan.items()}  # an unknown row raises
        # Every phase has a row: one the plan leaves out moves nothing.
        self.plan: ResidencyPlan = {phase: rows.get(phase, {}) for phase in Phase}
        self.models = {name: model for name, model in models.items() if model is not None}

    def enter(self, phase: Phase | str) -> Moved:
        """Make ``phase``'s row true on this rank (moving state is local: no collective); raises
        if a model then disagrees with the row, and for a name that is not a ``Phase``."""
        moved = Moved()
        for name, need in self.plan[Phase.named(phase)].items():
            model = self.models.get(name)
            if model is None:
                continue
            if need.off:
                stats = model.offload(**{kind: kind in need.off for kind in KINDS})
                moved.offload_bytes += stats.bytes
                moved.offload_seconds += stats.seconds
            if need.on:
                stats = model.onload(**{kind: kind in need.on for kind in KINDS})
                moved.onload_bytes += stats.bytes
                moved.onload_seconds += stats.seconds
            resident = self.on_device(name)
            if not need.on <= resident or need.off & resident:
                raise RuntimeError(
                    f"phase {phase}: {name} holds {sorted(resident)} on the device, the plan "
                    f"asks ON {sorted(need.on)}, OFF {sorted(need.off)}"
                )
        return moved

    def reserve_host_buffers(self) -> tuple[int, float]:
        """Pin now the host buffers of every kind some phase sends OFF the device
        (``parallel.offload.Offloader.reserve``): pinning gigabytes takes seconds on a GPU node,
        far longer than the copy, so the run pays it once at build time and every offload is only
        a copy. Returns the bytes allocated and the seconds it took."""
        allocated, seconds = 0, 0.0
        for name, model in self.models.items():
            off = {kind for row in self.plan.values() if name in row for kind in row[name].off}
            if off:
                stats = model.offloader.reserve(**{kind: kind in off for kind in KINDS})
                allocated += stats.allocated_bytes
                seconds += stats.allocation_seconds
        return allocated, seconds

    def on_device(self, name: str) -> frozenset[str]:
        """The kinds of state model ``name`` holds on the device now (a frozen model has only
        its params)."""
        model = self.models[name]
        kinds = KINDS if model.optimizer is not None else ("params",)
        return frozenset(kind for kind in kinds if not model.offloader.is_offloaded(kind))


@dataclass
class StepPhases:
    """The step's clock: ``with phases("update"):`` first makes the residency of the "update"
    row (timed as ``timing/offload`` / ``timing/onload``, bytes counted), then times the phase
    (``timing/update``). ``phases.timer`` times sub-phases (``timing/gen``, ``timing/reward``)."""

    residency: Residency
    timer: Timer = field(default_factory=Timer)
    moved: Moved = field(default_factory=Moved)

    @contextmanager
    def __call__(self, phase: Phase | str, timed: bool = True) -> Iterator[None]:
        """``timed=False``: a phase whose parts time themselves (the rollout's gen and reward),
        so that no timer nests in another and the parts add up to the step. A name that is not
        a ``Phase`` raises before anything moves."""
        phase = Phase.named(phase).value
        moved = self.residency.enter(phase)
        self.moved.add(moved)
        self.timer.add("offload", moved.offload_seconds)
        self.timer.add("onload", moved.onload_seconds)
        if not timed:
            yield
            return
        with self.timer(phase):
            yield

    @contextmanager
    def step(self) -> Iterator[None]:
        """The whole step (``timing/step``), however it ends."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timer.add("step", time.perf_counter() - start)

    def metrics(self) -> dict[str, float]:
        return {
            **self.timer.metrics(),
            "offload/bytes_gb": self.moved.offload_bytes / 1e9,
            "onload/bytes_gb": self.moved.onload_bytes / 1e9,
        }
