"""Rollout engines: the interface, the factory and the weight transports."""

from rlcli.rollout.base import (
    Completion,
    GenerationRequest,
    ReplicaInfo,
    RolloutEngine,
    SamplingConfig,
)
from rlcli.rollout.factory import make_engine
from rlcli.rollout.transport import WeightTransport, make_transport

__all__ = [
    "Completion",
    "GenerationRequest",
    "ReplicaInfo",
    "RolloutEngine",
    "SamplingConfig",
    "WeightTransport",
    "make_engine",
    "make_transport",
]
