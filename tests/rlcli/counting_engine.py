"""A real engine with its wake / sleep / generate calls counted in order (the rollout-phase tests
check how a step drives the engine: one awake block, one batched call per turn)."""

from __future__ import annotations


class CountingEngine:
    """The real engine, with its calls counted in order."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    def wake_up(self) -> None:
        self.calls.append("wake_up")
        self.engine.wake_up()

    def sleep(self) -> None:
        self.calls.append("sleep")
        self.engine.sleep()

    def generate(self, prompts, n, sampling, images=None):  # single-turn rollouts
        self.calls.append(f"generate({len(prompts)})")
        return self.engine.generate(prompts, n, sampling, images)

    def generate_requests(self, requests):  # a multi-turn turn
        self.calls.append(f"generate({len(requests)})")
        return self.engine.generate_requests(requests)

    def __getattr__(self, name):  # the rest as the engine has it
        return getattr(self.engine, name)
