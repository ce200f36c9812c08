"""Rollout engines: the interface, the factory and the trainer-vs-engine log-prob metric."""

from rlcli.rollout.base import (
    ENGINE_KINDS,
    Completion,
    RolloutEngine,
    SamplingConfig,
    rollout_replicas,
)
from rlcli.rollout.factory import make_engine
from rlcli.rollout.metrics import logprob_mismatch

__all__ = [
    "ENGINE_KINDS",
    "Completion",
    "RolloutEngine",
    "SamplingConfig",
    "logprob_mismatch",
    "make_engine",
    "rollout_replicas",
]
