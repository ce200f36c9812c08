"""The rollout-engine interface: what the trainer asks of an inference engine.

An engine answers requests (token ids + sampling parameters in; `n` completions of token ids +
sampled-token log-probs out; `generate_requests`, which a multi-turn loop calls turn by turn),
sleeps between rollout phases, and takes new weights as `(hf_name, tensor)` lists streamed by
`parallel.reshard` through a weight transport (`rlcli.rollout.transport`). Two engines implement
it: colocated vLLM (`vllm_engine.py`) and HF transformers `generate` (`hf_engine.py`, the
reference and the fallback when vLLM is absent); `rlcli.rollout.factory` builds them from the
`rollout` config section. Which replica a rank's engine belongs to is ``ReplicaInfo``, computed
once, by the engine itself (``engine.replica``).
"""

from __future__ import annotations

import json
import os
import random
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from rlcli.data.images import ProcessedPrompt
from rlcli.errors import UserError


@dataclass
class SamplingConfig:
    """How to sample. `temperature == 0` is greedy; `top_k <= 0` and `top_p == 1` disable those
    filters. `seed` None: the engine draws request seeds from its own seeded stream."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's EOS
    seed: int | None = None
    logprobs: bool = True  # return the sampled tokens' log-probs
    # MoE models: also return the experts of every token the model read (Completion.routing);
    # only engines that can read their routers take it (the HF engine)
    routing: bool = False


@dataclass
class Completion:
    """One sampled response. `logprobs[i]` is log p(token_ids[i]) under log_softmax(logits / T)
    (after top-k / top-p masking when those are on); empty when logprobs were not requested."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    # [prompt + response - 1, L, k] int16 when asked (SamplingConfig.routing): the experts each
    # token the model read went to, in every MoE layer (the last response token is never read)
    routing: torch.Tensor | None = None


@dataclass
class GenerationRequest:
    """One prompt to continue: its exact token ids (never re-tokenized), how to sample, how many
    completions, and the seed of the first (completion i uses `seed + i`, as vLLM does)."""

    prompt_token_ids: list[int]
    sampling: SamplingConfig
    n: int = 1
    seed: int | None = None  # None: drawn from the engine's seeded stream
    # A vision-language prompt's images (its placeholders already expanded in
    # prompt_token_ids): the PIL images and what the model's processor made of them.
    images: ProcessedPrompt | None = None


def copies(completion: Completion, n: int) -> list[Completion]:
    """`n` independent copies (greedy decoding samples one completion per prompt)."""
    return [
        Completion(
            list(completion.token_ids),
            list(completion.logprobs),
            completion.finish_reason,
            completion.routing,
        )
        for _ in range(n)
    ]


@dataclass
class SequenceLogProbs:
    """A scored sequence of ``n`` tokens (``RolloutEngine.sequence_log_probs``): the log-prob of
    each token after the first (``log_probs [n-1]``) and, at each of those positions, the
    ``top_k`` likeliest tokens' log-probs and ids (``top_log_probs`` / ``top_ids [n-1, top_k]``,
    likeliest first; ``top_k`` 0: empty), at temperature 1."""

    log_probs: list[float]
    top_log_probs: torch.Tensor
    top_ids: torch.Tensor


@dataclass(frozen=True)
class ReplicaInfo:
    """Which engine replica a rank serves: adjacent groups of `size` ranks (the engine section's
    `tp`) form one engine; replica `index` of `count` is ranks [index * size, (index + 1) * size).
    Its first rank (`is_leader`) reports what the replica samples (the others hold the same)."""

    index: int
    count: int
    is_leader: bool
    size: int = 1

    @classmethod
    def of(cls, world_size: int, rank: int, tp: int) -> ReplicaInfo:
        """Rank `rank`'s replica in a world of `world_size` ranks, engines of `tp` ranks."""
        if tp < 1 or world_size % tp != 0:
            raise UserError(
                f"rollout.tp={tp} must divide the number of processes ({world_size}); "
                f"choose a divisor of {world_size}"
            )
        return cls(index=rank // tp, count=world_size // tp, is_leader=rank % tp == 0, size=tp)

    @property
    def first_rank(self) -> int:
        return self.index * self.size


def current_replica(tp: int) -> ReplicaInfo:
    """`ReplicaInfo.of` this process: torch.distributed's world, else torchrun's environment
    (RANK, WORLD_SIZE), else a world of one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    else:
        world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    return ReplicaInfo.of(world_size, rank, tp)


class RolloutEngine(ABC):
    """A colocated inference engine holding one replica (or one TP shard) of the policy.

    `replica`: which replica this rank's engine is (`current_replica` of its section's tp);
    `seed`: the run's seed, from which requests without a seed draw theirs (the same stream on
    every rank, so the ranks of one TP replica agree)."""

    # Whether `load_lora_adapter` works (vLLM started with room for adapters).
    takes_lora_adapters: bool = False
    # Whether requests may carry images (a vision-language model, on an engine that feeds them).
    takes_images: bool = False

    def __init__(self, seed: int, replica: ReplicaInfo) -> None:
        self.replica = replica
        self._seeds = random.Random(seed)

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        sampling: SamplingConfig,
        images: Sequence[ProcessedPrompt | None] | None = None,
    ) -> list[list[Completion]]:
        """Sample `n` completions for each prompt; returns [len(prompts)][n]. Each (replica,
        prompt) gets its own block of `n` seeds (`request_seed`) from `sampling.seed`.
        `images`: each prompt's images (None for a text prompt; only where `takes_images`)."""
        base_seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(31)
        images = images or [None] * len(prompt_token_ids)
        requests = [
            GenerationRequest(
                ids, sampling, n, request_seed(base_seed, self.replica.index, i, n), prompt_images
            )
            for i, (ids, prompt_images) in enumerate(zip(prompt_token_ids, images, strict=True))
        ]
        return self.generate_requests(requests)

    @abstractmethod
    def generate_requests(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """Answer each request with `request.n` completions, in order. Every rank of one TP
        replica calls it with the same requests (an empty list included)."""

    @abstractmethod
    def sequence_log_probs(
        self, sequences: list[list[int]], top_k: int = 0
    ) -> list[SequenceLogProbs]:
        """Score given token ids instead of sampling: for each sequence, the log-prob of every
        token after the first given the tokens before it (``len - 1`` values, at temperature 1),
        and at each of those positions the ``top_k`` likeliest tokens (a top-k distillation
        objective). Every rank of one TP replica calls it with the same sequences (an empty
        list included). On-policy distillation's teacher on an engine
        (``distill.teacher_engine``) uses it."""

    @abstractmethod
    def sleep(self) -> None:
        """Release memory between rollout phases (KV cache, and on GPU the weights)."""

    @abstractmethod
    def wake_up(self) -> None:
        """Restore what `sleep` released; call before `generate`."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Overwrite weights in place, by HF parameter name (full, unsharded tensors). Fused
        layers need their parts in one call: q, k, v (+ biases) together, gate and up together."""

    @abstractmethod
    def close(self) -> None:
        """Free the engine; it cannot be used afterwards."""

    def load_lora_adapter(self, folder: str) -> None:
        """Load the PEFT adapter folder `folder` (read before this returns) in place of the
        previous one; later `generate` calls sample with it. Only where `takes_lora_adapters`."""
        raise NotImplementedError(f"{type(self).__name__} cannot load LoRA adapters")

    @property
    def needs_weight_sync(self) -> bool:
        """True while the engine's weights are not the policy's (started with dummy weights, or
        discarded by a level-2 sleep): the trainer must sync before the next `generate`."""
        return False


def model_path_key(key: str) -> str:
    """The config key of the model an engine section's engine serves: ``model.path`` for the
    policy's (``rollout``), the teacher's ``distill.teacher_path``, ``<key>.path`` for another
    engine's (``reward.judge.path``)."""
    named = {"rollout": "model.path", "distill.teacher": "distill.teacher_path"}
    return named.get(key, f"{key}.path")


def read_hf_config(model_dir: str, key: str = "rollout") -> dict:
    """config.json of an HF model directory; a UserError naming the model's path key (see
    ``model_path_key``) when missing."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        path_key = model_path_key(key)
        raise UserError(
            f"{path_key}={model_dir!r} is not a HuggingFace model directory (no config.json); "
            f"point {path_key} at a folder with config.json and *.safetensors"
        )
    return json.loads(config_file.read_text())


def model_eos_token_ids(model_dir: str) -> list[int]:
    """EOS ids from config.json and generation_config.json (int or list in either)."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            for token in eos if isinstance(eos, list) else [eos]:
                if token is not None and token not in ids:
                    ids.append(int(token))
    return ids


def request_seed(base_seed: int, replica_index: int, prompt_index: int, n: int) -> int:
    """Seed of prompt `prompt_index` on replica `replica_index`. Each (replica, prompt) owns a
    block of `n` consecutive seeds, because vLLM seeds sample i of a request with seed + i."""
    return base_seed + ((replica_index << 24) + prompt_index) * n


@contextmanager
def awake(engine: RolloutEngine) -> Iterator[None]:
    """The engine holds its KV cache only while it generates; on GPU, ``sleep`` hands the memory
    back to Megatron for the log-prob and update phases (a no-op on CPU)."""
    engine.wake_up()
    try:
        yield
    finally:
        engine.sleep()
