"""Per-GPU memory of a colocated RL layout: the formulas, in one place, with their sources.

Pure arithmetic on a model shape and a layout; nothing here allocates or imports megatron.

    shape = ModelShape.from_hf_config(json.load(open("config.json")))
    plan = plan_memory(PlanInputs(actor=TrainedModel(shape, tp=4, dp=4, ...), ...))
    plan.phases["update"].total, plan.peak_phase, plan.fits

Sources:
  [ZeRO]  Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
          Models", section 3.1: mixed-precision Adam keeps 2 + 2 + 12 bytes per parameter (16-bit
          weights and gradients, fp32 master weights, momentum, variance).
  [MCORE] megatron-core's distributed optimizer docs (docs/source/api-guide/dist_optimizer.md),
          bytes per parameter, d = data-parallel size:
              fp16 param, fp16 grads: 20 non-distributed, 4 + 16/d distributed
              bf16 param, fp32 grads: 18 non-distributed, 6 + 12/d distributed
              fp32 param, fp32 grads: 16 non-distributed, 8 + 8/d distributed
          i.e. weights and the gradient buffer stay whole on every rank; fp32 master weights (not
          for fp32 models) and Adam's two moments are sharded over DP by the distributed optimizer.
  [KORT]  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
          Models", section 4 and Table 2: activations per layer of s*b*h*(34 + 5*a*s/h) bytes with
          16-bit activations; the parts inside a TP region divide by t, sequence parallelism
          divides the rest by t; selective recomputation drops the 5*a*s^2*b attention-score term;
          full recomputation keeps only each layer's 2*s*b*h input. 1F1B keeps up to p
          micro-batches in flight on the first stage.
  [VLLM]  vLLM's KV cache: 2 (K and V) * num_layers * (kv_heads / tp) * head_dim * dtype bytes per
          token (vllm/v1/kv_cache_interface.py, AttentionSpec.page_size_bytes), inside the budget
          gpu_memory_utilization * total memory minus its weights and activation peak
          (vllm/v1/worker/gpu_worker.py, determine_available_memory).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from parallel.model_shapes import ModelShape, max_stage_params, padded_vocab

GB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RECOMPUTE_MODES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
PHASES = ("generate", "log_probs", "update", "sync")
# CUDA context, NCCL communicators and allocator slack, per GPU (not in any formula above; a
# measured-order-of-magnitude reserve so "fits" does not mean "fits with 0 bytes to spare").
RUNTIME_RESERVE_BYTES = int(2.0 * GB)


def recompute_options(mode: str, method: str = "uniform", num_layers: int = 1) -> dict[str, Any]:
    """TransformerConfig fields for `actor.recompute` (megatron-core's recompute_granularity,
    recompute_method, recompute_num_layers). selective recomputes core attention."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    if mode == "none":
        return {}
    if mode == "selective":
        return {"recompute_granularity": "selective"}
    if method not in RECOMPUTE_METHODS:
        raise ValueError(f"recompute method {method!r}: choose one of {RECOMPUTE_METHODS}")
    return {
        "recompute_granularity": "full",
        "recompute_method": method,
        "recompute_num_layers": num_layers,
    }


# ---------------------------------------------------------------------------------------------
# Training state


@dataclass(frozen=True)
class TrainedModel:
    """A model trained with megatron on every GPU (the actor; the PPO critic is another one)."""

    shape: ModelShape
    dtype: str = "bfloat16"
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    dp: int = 1
    distributed_optimizer: bool = False
    grad_reduce_in_fp32: bool = True  # parallel.optim.wrap_for_training's default
    micro_batch_size: int = 1
    seq_len: int = 1024
    num_micro_batches: int = 1  # per optimizer step on one DP rank (bounds pipeline in-flight)
    recompute: str = "none"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    sequence_parallel: bool = False
    flash_attention: bool = True  # Transformer Engine / flash attention: no s^2 score tensor
    critic: bool = False
    offload_params: bool = False
    offload_grads: bool = False
    offload_optimizer: bool = False

    @property
    def params(self) -> int:
        return max_stage_params(self.shape, tp=self.tp, pp=self.pp, critic=self.critic)


def weight_bytes(model: TrainedModel) -> int:
    return model.params * DTYPE_BYTES[model.dtype]  # [MCORE] 16-bit (or fp32) model weights


def grad_numel_bytes(params: int, *, dtype: str, grad_reduce_in_fp32: bool = True) -> int:
    """DDP's contiguous gradient buffer: fp32 when grad_reduce_in_fp32 (or an fp32 model) [MCORE].
    With the distributed optimizer the buffer is padded to a multiple of dp (a few elements)."""
    return params * (4 if grad_reduce_in_fp32 else DTYPE_BYTES[dtype])


def optimizer_state_numel(params: int, *, dtype: str, dp: int = 1, distributed: bool = False):
    """Elements of optimizer state on one rank: fp32 master weights (16-bit models only) and
    Adam's exp_avg / exp_avg_sq [ZeRO 3.1], sharded over DP by the distributed optimizer [MCORE]
    (each rank's shard is its 1/dp of the padded gradient buffer). All fp32."""
    per_param = 2 + (1 if dtype != "float32" else 0)
    return per_param * (math.ceil(params / dp) if distributed else params)


def grad_bytes(model: TrainedModel) -> int:
    return grad_numel_bytes(
        model.params, dtype=model.dtype, grad_reduce_in_fp32=model.grad_reduce_in_fp32
    )


def optimizer_bytes(model: TrainedModel, *, distributed: bool | None = None) -> int:
    distributed = model.distributed_optimizer if distributed is None else distributed
    return 4 * optimizer_state_numel(
        model.params, dtype=model.dtype, dp=model.dp, distributed=distributed
    )


def layer_activation_bytes(model: TrainedModel, *, recompute_attention: bool) -> int:
    """Bytes one transformer layer saves for backward for one micro-batch, after [KORT] Table 2,
    generalised to SwiGLU (fc1 output 2f, fc2 input f) and GQA, without dropout masks (dropout
    is off), per token:

      Transformer Engine (fused norm+linear, flash attention): norms 2 x (input, normed output)
        = 4h; attention q, k, v (a + 2g) * d and its output a * d; MLP 3f.
      megatron's local spec (torch RMSNorm, unfused attention), counted tensor by tensor with
        torch.autograd.graph.saved_tensors_hooks on a real layer: norms 2 x (input, normed,
        weighted) = 6h; q, and k and v expanded to a heads for the bmm, and the output: 4 * a*d;
        the softmax output a * s per token (the s^2 term); MLP 5f (fc1 out 2f, gate, up, silu
        out, product).
    Selective recomputation of core attention keeps only its inputs and output instead: the
    roped q and k ((a + g) * d), v (a view that keeps the whole fused QKV output, (a + 2g) * d,
    alive) and the output a * d. Terms over heads and ffn are inside TP regions (divide by t); the h terms
    divide by t only with sequence parallelism."""
    s, b, e, t = model.seq_len, model.micro_batch_size, DTYPE_BYTES[model.dtype], model.tp
    sh = model.shape
    qkv, attn_out = (sh.heads + 2 * sh.kv_heads) * sh.head_dim, sh.heads * sh.head_dim
    if model.flash_attention:
        outside, inside = 4 * sh.hidden, qkv + attn_out + 3 * sh.ffn
    else:
        outside = 6 * sh.hidden
        kv = sh.kv_heads * sh.head_dim
        attention = qkv + kv + 2 * attn_out if recompute_attention else 4 * attn_out + sh.heads * s
        inside = attention + 5 * sh.ffn
    outside /= t if model.sequence_parallel else 1
    return int(s * b * e * (outside + inside / t))


# Bytes per entry of this TP rank's [tokens, V/tp] logits at the log-prob peak. Forward only:
# the logits in the model dtype (2), then three float32 tensors alive together: the cast, the
# division by the temperature and the exponentials of the softmax (parallel.schedule,
# parallel.logprobs): 2 + 3 * 4 = 14. Training adds, during backward, the recomputed
# exponentials, the float32 gradient and its cast back to the model dtype while the saved
# float32 logits are still held: about 22. Measured on one H200 (bf16, 4 x 1024 tokens, vocab
# 151,936, local layers): the forward-only peaks of the Qwen2.5-0.5B and 1.5B shapes imply 13.7
# and 13.4 bytes per entry, the update peaks 25.9 and 21.8 (gpu-check's memory probe).
LOGIT_BYTES_FORWARD = 14
LOGIT_BYTES_TRAINING = 22


def logits_bytes(
    model: TrainedModel, micro_batch_size: int | None = None, training: bool = True
) -> int:
    """The output layer's logits on the last stage and the float32 work of the vocab-parallel
    log-softmax for one micro-batch (see the constants above); a critic's values are [s, b]."""
    b = micro_batch_size or model.micro_batch_size
    vocab_slice = padded_vocab(model.shape.vocab, model.tp) // model.tp
    if model.critic:
        return model.seq_len * b * 4
    per_entry = LOGIT_BYTES_TRAINING if training else LOGIT_BYTES_FORWARD
    return model.seq_len * b * vocab_slice * per_entry


def activation_bytes(model: TrainedModel) -> int:
    """Peak saved activations of one training micro-batch schedule on the busiest stage [KORT]."""
    layers = model.shape.layers // model.pp
    full_layer = layer_activation_bytes(model, recompute_attention=model.recompute != "none")
    layer_input = (
        model.seq_len
        * model.micro_batch_size
        * DTYPE_BYTES[model.dtype]
        * model.shape.hidden
        // (model.tp if model.sequence_parallel else 1)
    )
    if model.recompute == "full":
        k = min(model.recompute_num_layers, layers)
        if model.recompute_method == "uniform":
            # each group of k layers keeps its input; backward rebuilds one group at a time
            per_micro = math.ceil(layers / k) * layer_input + k * full_layer
        else:  # block: the first k layers of the stage keep only their inputs
            per_micro = k * layer_input + (layers - k) * full_layer + full_layer
    else:
        per_micro = layers * full_layer
    in_flight = min(model.pp, model.num_micro_batches)
    if model.vpp:
        in_flight = math.ceil(in_flight * (1 + (model.pp - 1) / (model.pp * model.vpp)))
    return in_flight * per_micro + logits_bytes(model)


def forward_only_bytes(model: TrainedModel, micro_batch_size: int) -> int:
    """Log-prob / value forward: nothing is saved for backward; one layer's working set and the
    logits of one micro-batch."""
    one = dataclasses.replace(model, micro_batch_size=micro_batch_size, recompute="none")
    return layer_activation_bytes(one, recompute_attention=False) + logits_bytes(
        one, training=False
    )


# ---------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class RolloutEngine:
    tp: int = 1
    gpu_memory_utilization: float = 0.5
    max_model_len: int = 1024
    sequences: int = 1  # concurrent sequences one engine is asked for (prompts * n)
    dtype: str = "bfloat16"
    sync_bucket_bytes: int = 512 * 1024**2


@dataclass(frozen=True)
class PlanInputs:
    actor: TrainedModel
    rollout: RolloutEngine
    gpu_memory_bytes: int
    ref: bool = False  # a frozen reference model with the actor's shape and layout
    ref_offload: bool = False
    critic: TrainedModel | None = None


@dataclass
class Phase:
    terms: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.terms.values())


@dataclass
class MemoryPlan:
    inputs: PlanInputs
    components: dict[str, int]
    phases: dict[str, Phase]
    vllm_weights: int
    kv_cache: int
    kv_cache_needed: int

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: self.phases[name].total)

    @property
    def peak(self) -> int:
        return self.phases[self.peak_phase].total

    @property
    def fits(self) -> bool:
        return self.peak <= self.inputs.gpu_memory_bytes and self.kv_cache > 0


def vllm_weight_bytes(shape: ModelShape, rollout: RolloutEngine) -> int:
    full = max_stage_params(shape, tp=rollout.tp, pp=1)
    return full * DTYPE_BYTES[rollout.dtype]


def kv_bytes_per_token(shape: ModelShape, rollout: RolloutEngine) -> int:
    kv_heads = max(1, shape.kv_heads // rollout.tp)  # vLLM replicates KV heads when tp > g
    return 2 * shape.layers * kv_heads * shape.head_dim * DTYPE_BYTES[rollout.dtype]  # [VLLM]


def _trained_terms(model: TrainedModel, prefix: str) -> dict[str, int]:
    return {
        f"{prefix} weights": weight_bytes(model),
        f"{prefix} grads": grad_bytes(model),
        f"{prefix} optimizer": optimizer_bytes(model),
    }


def _resident(model: TrainedModel, prefix: str, *, params: bool, grads: bool, opt: bool):
    """The model's training state that stays on the GPU, given which kinds are onloaded."""
    terms = _trained_terms(model, prefix)
    keep = {
        f"{prefix} weights": params or not model.offload_params,
        f"{prefix} grads": grads or not model.offload_grads,
        f"{prefix} optimizer": opt or not model.offload_optimizer,
    }
    return {name: value for name, value in terms.items() if keep[name]}


def plan_memory(inputs: PlanInputs) -> MemoryPlan:
    """Bytes per GPU of each phase of one colocated RL step (see the module docstring)."""
    actor, rollout = inputs.actor, inputs.rollout
    models = [(actor, "actor")] + ([(inputs.critic, "critic")] if inputs.critic else [])
    ref_weights = weight_bytes(actor) if inputs.ref else 0
    vllm_weights = vllm_weight_bytes(actor.shape, rollout)
    vllm_budget = int(rollout.gpu_memory_utilization * inputs.gpu_memory_bytes)
    # vLLM's own activation peak while profiling: one forward at max_num_batched_tokens
    vllm_activations = int(2 * rollout.max_model_len * actor.shape.hidden * 4)
    kv_cache = vllm_budget - vllm_weights - vllm_activations
    kv_needed = kv_bytes_per_token(actor.shape, rollout) * rollout.max_model_len * rollout.sequences
    reserve = {"runtime reserve": RUNTIME_RESERVE_BYTES}
    ref_idle = {"ref weights": ref_weights} if ref_weights and not inputs.ref_offload else {}

    def idle(**onloaded: bool) -> dict[str, int]:
        terms: dict[str, int] = {}
        for model, prefix in models:
            terms.update(_resident(model, prefix, **onloaded))
        return terms

    generate = {
        **idle(params=False, grads=False, opt=False),
        **ref_idle,
        "vLLM (gpu_memory_utilization)": vllm_budget,
        **reserve,
    }
    fwd = max(forward_only_bytes(m, m.micro_batch_size) for m, _ in models)
    log_probs = {
        **idle(params=True, grads=False, opt=False),
        "ref weights": ref_weights,
        "forward working set": fwd,
        **reserve,
    }
    update = {**idle(params=True, grads=True, opt=True), **ref_idle, **reserve}
    # the critic updates before the actor, one after the other: the larger activation peak counts
    update["activations"] = max(activation_bytes(m) for m, _ in models)
    sync = {
        **idle(params=True, grads=False, opt=False),
        **ref_idle,
        "vLLM weights": vllm_weights,
        "sync buckets": 2 * rollout.sync_bucket_bytes,
        **reserve,
    }
    phases = {
        name: Phase({k: v for k, v in terms.items() if v})
        for name, terms in zip(PHASES, (generate, log_probs, update, sync), strict=True)
    }
    components = {
        **{k: v for m, p in models for k, v in _trained_terms(m, p).items()},
        "actor optimizer (distributed)": optimizer_bytes(actor, distributed=True),
        "actor optimizer (not distributed)": optimizer_bytes(actor, distributed=False),
        "activations (largest micro-batch)": activation_bytes(actor),
        "ref weights": ref_weights,
        "vLLM weights": vllm_weights,
        "vLLM KV cache": max(kv_cache, 0),
    }
    return MemoryPlan(inputs, components, phases, vllm_weights, kv_cache, kv_needed)
