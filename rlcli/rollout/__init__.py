"""Rollout engines: the interface, the factory and the weight transports."""

from rlcli.rollout.base import (
    Completion,
    GenerationRequest,
    RolloutEngine,
    SamplingConfig,
    rollout_replicas,
)
from rlcli.rollout.factory import make_engine
from rlcli.rollout.transport import WeightTransport, make_transport

__all__ = [
    "Completion",
    "GenerationRequest",
    "RolloutEngine",
    "SamplingConfig",
    "WeightTransport",
    "make_engine",
    "make_transport",
    "rollout_replicas",
]
