"""The rollout ranks of ``rollout.placement=separate``: engines only, generating ahead of the trainer.

Each step's samples are one ``Sampler.collect`` (the colocated step's rollout phase, so
multi-turn tool rollouts and DAPO's dynamic sampling work unchanged: DAPO's extra rounds for
filtered groups draw further prompts from the stream while the trainer trains; the trainer's step
filters them, ``rlcli.rollout.dynamic_sampling``). The loop::

    wait for notice 0: the run's start step and loader position, the start weights
    for each step t from start + 1 to the last:
        until the engines hold version max(start, t - 1 - trainer.max_staleness): take the next
            notice (load its weights; evaluate them on the held-out prompts when it says so)
        collect step t's samples; rollout rank 0 sends them to the trainer (without waiting)
    take notices until the trainer says stop (the last weights are evaluated too)

So generation is throttled, never thrown away: the engines wait for weights rather than sample
with older ones. A SIGTERM here asks the trainer to stop (it checkpoints first); the trainer's
stop notice ends the loop, and a resume generates again from the trainer's consumed position.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from parallel.roles import RoleWorld
from rlcli.config.schema import RLConfig
from rlcli.data import PromptDataset, PromptLoader
from rlcli.process_lifetime import StopRequest, leave_for_a_restart, peer_lost
from rlcli.rollout.channel import Notice, RolloutChannel, StreamedBatch
from rlcli.rollout.sampling import Sampler
from rlcli.rollout.streamed import generating_version
from rlcli.rollout.transport import receive_weights
from rlcli.run.metrics import Timer


@dataclass
class RolloutWorker:
    cfg: RLConfig
    world: RoleWorld
    channel: RolloutChannel
    sampler: Sampler  # this rank's engine (a TP shard of a replica), rewards, agent loop
    loader: PromptLoader  # drawn from ahead of the trainer; set from notice 0 at the start
    val_data: PromptDataset | None
    total_steps: int
    version: int = -1  # the weights the engines hold
    # engine/idle_s (waiting for weights), engine/sync_s (loading them), engine/busy_s (collecting
    # a step's samples; engine/gen_s and engine/reward_s of it), since the previous batch
    engine_times: Timer = field(default_factory=Timer)
    _stop_forwarded: bool = False

    @property
    def is_leader(self) -> bool:
        return self.world.rank == 0  # sends what every rollout rank holds alike

    def fit(self) -> None:
        """Generate until the trainer says stop (the module docstring's loop); raises
        ``RunEnded`` when the trainer failed instead."""
        stop = StopRequest()
        try:
            self._serve(stop)
        except RuntimeError as error:
            if peer_lost(error):
                leave_for_a_restart(error)
            raise
        finally:
            stop.uninstall()
            self.sampler.close()

    def _serve(self, stop: StopRequest) -> None:
        notice = self._next_notice(stop)
        if notice.stop:
            return
        start = notice.version
        self.loader.load_state_dict(notice.start_loader)
        self._take(notice)
        step = start + 1
        k = self.cfg.trainer.max_staleness
        while True:
            self._forward_stop(stop)
            if step <= self.total_steps and self.version >= generating_version(step, start, k):
                self._generate(step)
                step += 1
                continue
            notice = self._next_notice(stop)
            if notice.stop:
                return
            self._take(notice)

    def _next_notice(self, stop: StopRequest) -> Notice:
        with self.engine_times("idle"):  # waiting for the trainer's weights
            return self.channel.receive_notice(between_polls=lambda: self._forward_stop(stop))

    def _take(self, notice: Notice) -> None:
        """The engines now hold ``notice.version`` (loaded when it carries weights); evaluate it
        when the notice says so."""
        if notice.version != self.version + 1 and self.version != -1:
            raise RuntimeError(f"weights {notice.version} announced after {self.version}")
        if notice.weights:
            with self.engine_times("sync"):
                receive_weights(self.world.weights, self.sampler.engine)
        self.version = notice.version
        if notice.validate:
            metrics = self._evaluate(notice.version)
            if self.is_leader:
                self.channel.send_validation(notice.version, metrics)

    def _evaluate(self, version: int) -> dict[str, float]:
        if self.val_data is None:
            return {}
        return self.sampler.evaluate(self.val_data, version)

    def _generate(self, step: int) -> None:
        before = self.loader.state_dict()
        timer = Timer()
        started = time.perf_counter()
        samples, metrics = self.sampler.collect(self.loader, step, timer)
        self.engine_times.add("busy", time.perf_counter() - started)
        engine = {
            key.replace("timing/", "engine/") + "_s": value
            for key, value in {**self.engine_times.metrics(), **timer.metrics()}.items()
        }
        self.engine_times = Timer()
        if self.is_leader:
            batch = StreamedBatch(
                step=step,
                samples=samples,
                metrics=metrics,
                weight_version=self.version,
                loader_before=before,
                loader_after=self.loader.state_dict(),
                engine=engine,
            )
            self.channel.send_batch(batch)

    def _forward_stop(self, stop: StopRequest) -> None:
        if stop.reason and not self._stop_forwarded:
            self.channel.request_stop(stop.reason)
            self._stop_forwarded = True
