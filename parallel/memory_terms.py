"""Per-GPU memory of a model trained with megatron-core: weights, gradients, optimizer state,
activations and logits, as formulas with their sources (`parallel.memory_plan` adds the rollout
engine and the phases of an RL step).

Pure arithmetic on a model shape and a layout; nothing here allocates or imports megatron.

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
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from parallel.model_shapes import (
    LORA_TARGET_MODULES,
    ModelShape,
    lora_stage_params,
    max_stage_params,
    padded_vocab,
)

GB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RECOMPUTE_MODES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")


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
    # LoRA (parallel.lora): rank 0 is full fine-tuning. With adapters the base is frozen: only
    # the adapters have gradients and optimizer state.
    lora_rank: int = 0
    lora_target_modules: tuple[str, ...] = LORA_TARGET_MODULES

    @property
    def params(self) -> int:
        """Base parameters on the busiest rank."""
        return max_stage_params(self.shape, tp=self.tp, pp=self.pp, critic=self.critic)

    @property
    def lora_params(self) -> int:
        """Adapter parameters on one rank (0 without LoRA); every stage holds the same count."""
        if self.lora_rank <= 0:
            return 0
        return lora_stage_params(
            self.shape,
            tp=self.tp,
            pp=self.pp,
            rank=self.lora_rank,
            target_modules=self.lora_target_modules,
        )

    @property
    def trainable_params(self) -> int:
        """Parameters with gradients and optimizer state: the adapters with LoRA, else all."""
        return self.lora_params if self.lora_rank > 0 else self.params


def weight_bytes(model: TrainedModel) -> int:
    # [MCORE] 16-bit (or fp32) model weights; LoRA adapters are in the model dtype too
    return (model.params + model.lora_params) * DTYPE_BYTES[model.dtype]


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
        model.trainable_params, dtype=model.dtype, grad_reduce_in_fp32=model.grad_reduce_in_fp32
    )


def optimizer_bytes(model: TrainedModel, *, distributed: bool | None = None) -> int:
    distributed = model.distributed_optimizer if distributed is None else distributed
    return 4 * optimizer_state_numel(
        model.trainable_params, dtype=model.dtype, dp=model.dp, distributed=distributed
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
