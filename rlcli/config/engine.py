"""The config every inference engine shares (``rollout.*`` in ``rlcli.config.schema``,
``reward.judge.*`` in ``rlcli.config.rewards``), in its own module so both can build on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class EngineConfig:
    """What every inference engine is built from (``rlcli.rollout.factory.make_engine``): the
    policy's rollout engine (``rollout.*``) and the generative judge's (``reward.judge.*``)."""

    engine: Literal["vllm", "hf"] = "vllm"  # the inference engine
    tp: int = 1  # inference tensor parallel size, independent of parallel.tp / parallel.pp
    # context length; None: rollout: data.max_prompt_length + rollout.max_tokens, judge: its model's
    max_model_len: Optional[int] = None
    gpu_memory_utilization: float = 0.5  # GPU: share of memory vLLM takes for weights + KV cache
    kv_cache_gb: float = 1.0  # CPU only: resident KV cache per engine
    enforce_eager: bool = True  # GPU: no CUDA graphs (faster start, slower decoding)

    @property
    def is_separate(self) -> bool:
        """The engines run on ranks of their own (``rollout.placement=separate``), not between
        the trainer's phases on its ranks (a judge's engine always shares them)."""
        return False
