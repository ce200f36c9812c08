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
          divides the rest by t; selective recomputation drops the 5*a*s^2*b attention-score term
          (so does any fused attention: TE's, torch SDPA's flash / memory-efficient kernels);
          full recomputation keeps only each layer's 2*s*b*h input. 1F1B keeps up to p
          micro-batches in flight on the first stage.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from parallel.model_shapes import (
    LORA_TARGET_MODULES,
    LinearAttentionShape,
    ModelShape,
    lora_stage_params,
    max_stage_params,
    padded_vocab,
    stage_expert_params,
    stage_params,
)

GB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class TrainedModel:
    """A model trained with megatron on every GPU (the actor; the PPO critic is another one; a
    frozen reward model is one that never trains)."""

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
    # the core attention (parallel.model_backends): "te" (TE's layers and attention), "sdpa"
    # (megatron's local layers with torch SDPA) or "local" (local layers, the unfused attention
    # that holds the s^2 score tensor)
    attention: str = "te"
    # whose kernels decide what the local layers save: "cuda" (what the plan is for) or "cpu"
    device: str = "cuda"
    critic: bool = False  # a one-output head (value, or a reward model's score) instead of the LM's
    head_bias: bool = True  # that head's bias: PPO's value head has one, a score head none
    offload_params: bool = False
    offload_grads: bool = False
    offload_optimizer: bool = False
    ep: int = 1  # MoE: expert parallel size
    etp: int | None = None  # MoE: the experts' tensor parallel size (None: tp)
    # LoRA (parallel.lora): rank 0 is full fine-tuning. With adapters the base is frozen: only
    # the adapters have gradients and optimizer state.
    train_vision_tower: bool = False  # a vision-language model's tower takes gradients
    lora_rank: int = 0
    lora_target_modules: tuple[str, ...] = LORA_TARGET_MODULES

    @property
    def params(self) -> int:
        """Base parameters on the busiest rank."""
        return max_stage_params(
            self.shape,
            tp=self.tp,
            pp=self.pp,
            critic=self.critic,
            head_bias=self.head_bias,
            ep=self.ep,
            etp=self.etp,
        )

    @property
    def expert_params(self) -> int:
        """Routed-expert parameters of the busiest stage (part of `params`)."""
        return max(self._split(r)[1] for r in range(self.pp))

    @property
    def expert_dp(self) -> int:
        """The ranks whose routed-expert optimizer state the distributed optimizer shards:
        tp*dp / (ep*etp) with expert parallelism; without it megatron treats experts as dense
        weights (sharded over DP)."""
        return self.tp * self.dp // (self.ep * (self.etp or self.tp)) if self.ep > 1 else self.dp

    def _split(self, pp_rank: int) -> tuple[int, int]:
        """(all, routed-expert) parameters of one rank of pipeline stage `pp_rank`."""
        etp = self.etp or self.tp
        total = stage_params(
            self.shape,
            tp=self.tp,
            pp=self.pp,
            pp_rank=pp_rank,
            critic=self.critic,
            head_bias=self.head_bias,
            ep=self.ep,
            etp=etp,
        )
        experts = stage_expert_params(self.shape, pp=self.pp, pp_rank=pp_rank, ep=self.ep, etp=etp)
        return total, experts

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

    def frozen_params(self, pp_rank: int) -> int:
        """A frozen vision tower's parameters on stage `pp_rank` (no gradient, no optimizer)."""
        vision = self.shape.vision
        return vision.params if vision and pp_rank == 0 and not self.train_vision_tower else 0

    @property
    def trainable_params(self) -> int:
        """Parameters with gradients and optimizer state on the busiest stage: the adapters with
        LoRA, else all but a frozen vision tower."""
        if self.lora_rank > 0:
            return self.lora_params
        return max(self._split(r)[0] - self.frozen_params(r) for r in range(self.pp))


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
    """Optimizer state of the busiest stage; the distributed optimizer shards dense weights'
    state over DP and routed experts' over the expert-DP group (megatron keeps the two apart)."""
    distributed = model.distributed_optimizer if distributed is None else distributed

    def numel(params: int, dp: int) -> int:
        return optimizer_state_numel(params, dtype=model.dtype, dp=dp, distributed=distributed)

    if model.lora_rank > 0:  # the frozen base (experts too) has no optimizer state
        return 4 * numel(model.lora_params, model.dp)
    per_stage = []
    for pp_rank in range(model.pp):
        total, experts = model._split(pp_rank)
        dense = total - experts - model.frozen_params(pp_rank)
        per_stage.append(numel(dense, model.dp) + numel(experts, model.expert_dp))
    return 4 * max(per_stage)


ATTENTIONS = ("te", "sdpa", "local")


def layer_activation_bytes(model: TrainedModel, *, recompute_attention: bool) -> int:
    """Bytes one transformer layer saves for backward for one micro-batch, after [KORT] Table 2,
    generalised to SwiGLU (fc1 output 2f, fc2 input f) and GQA, without dropout masks (dropout
    is off). Per token, with e bytes per element of the model dtype, a = heads x head_dim,
    g = kv_heads x head_dim:

      Transformer Engine (fused norm+linear, flash attention): norms 2 x (input, normed output)
        = 4h; attention q, k, v (a + 2g) and its output a; MLP 3f; all e bytes each.
      megatron's local layers, counted tensor by tensor with torch.autograd.graph.
        saved_tensors_hooks on real layers in fp32 and bf16 on CPU (tests/parallel/
        offload_worker.py): MLP 5f x e (fc1 out 2f, gate, up, silu out, product); the torch
        RMSNorms: on CUDA torch's fused kernel keeps each norm's input (and a per-row rstd),
        the next linear the normed output, 2 x 2h x e (what the kernel saves, not measured
        here); on CPU the composite norm keeps the input in fp32, that times rsqrt (fp32) and
        the output, 2 x (8 + e) h bytes; and
        - sdpa: the fused QKV output (a + 2g, alive through v, a view of it), the roped q (a)
          and k (g), the output (a, also linear_proj's input on CPU; on CUDA the flash kernel
          writes it [b, s, h, d], so the [s, b, h x d] input of linear_proj is a copy: one a
          more): (3a + 3g) x e, and the softmax log-sum-exp, 4 bytes per head;
        - local (unfused): q, and k and v expanded to a heads for the bmm, and the output:
          4a x e; the fp32 softmax output, 4 x heads x s bytes (the s^2 term), and its cast to
          the model dtype for the bmm when that is not fp32, e x heads x s.
    Selective recomputation of core attention keeps only its inputs and output instead: the
    roped q and k, v (keeping the whole fused QKV output alive) and the output, (3a + 3g) x e.
    Terms over heads and ffn are inside TP regions (divide by t); the h terms divide by t only
    with sequence parallelism.

    MoE layers (an estimate from the layer's structure, not measured): the MLP terms with f =
    k * moe_ffn (each token runs through its k experts; on average every EP rank computes k x
    its own tokens) divided by the expert TP instead of t, plus the shared expert's width, plus
    the dispatcher's permuted tokens in and out (2 k h) and the router's E probabilities per
    token. Every layer of a MoE model is counted as a MoE layer (an upper bound when some are
    dense). A hybrid model's layers (Qwen3.5: Gated DeltaNet or attention) are each counted as
    the larger kind (`delta_net_bytes_per_token`)."""
    if model.attention not in ATTENTIONS:
        raise ValueError(f"attention {model.attention!r}: choose one of {ATTENTIONS}")
    s, b, e, t = model.seq_len, model.micro_batch_size, DTYPE_BYTES[model.dtype], model.tp
    sh = model.shape
    a, g = sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim
    cuda = model.device == "cuda"
    ffn, dispatch = sh.ffn, 0
    if sh.is_moe:
        ffn = sh.topk * sh.moe_ffn * t / (model.etp or t) + sh.shared_ffn
        dispatch = 2 * sh.topk * sh.hidden + sh.experts
    if model.attention == "te":
        outside, inside = (4 * sh.hidden + dispatch) * e, (a + 2 * g + a + 3 * ffn) * e
    else:
        outside = (4 * sh.hidden * e if cuda else 2 * (8 + e) * sh.hidden) + dispatch * e
        if recompute_attention:
            attention = (3 * a + 3 * g) * e
        elif model.attention == "sdpa":
            attention = (3 * a + 3 * g + (a if cuda else 0)) * e + 4 * sh.heads
        else:
            attention = 4 * a * e + sh.heads * s * (4 + (e if e != 4 else 0))
        inside = attention + 5 * ffn * e
    if sh.linear is not None:  # a hybrid: count each layer as the larger of its two kinds
        inside = max(inside, inside - attention + delta_net_bytes_per_token(sh.linear, e))
    outside /= t if model.sequence_parallel else 1
    return int(s * b * (outside + inside / t))


DELTA_NET_CHUNK = 64  # tokens per chunk of the chunked delta rule (fla's and megatron's torch one)


def delta_net_bytes_per_token(linear: LinearAttentionShape, e: int) -> float:
    """What one Gated DeltaNet saves for backward per token, all inside the TP region (an
    estimate from the layer's structure, not measured): in_proj's output (q, k, v, z, beta,
    alpha), the conv's input to its activation and the activation's output over q, k, v, the
    L2-normed q and k repeated to the value heads, the delta rule's output and the gated norm's
    input and output (3 V), all e bytes; and the recurrent state the chunked rule keeps at each
    chunk boundary, value heads x key dim x value dim in fp32 per 64 tokens."""
    keys = linear.key_heads * linear.key_dim
    values = linear.value_heads * linear.value_dim
    in_proj = 2 * keys + 2 * values + 2 * linear.value_heads
    conv = 2 * (2 * keys + values)
    normed = 2 * linear.value_heads * linear.key_dim
    state = linear.value_heads * linear.key_dim * linear.value_dim * 4 / DELTA_NET_CHUNK
    return (in_proj + conv + normed + 3 * values) * e + state


# Bytes per entry of this TP rank's [tokens, V/tp] logits at the log-prob peak. Forward only:
# the logits in the model dtype (2), then three float32 tensors alive together: the cast, the
# division by the temperature and the exponentials of the softmax (parallel.schedule,
# parallel.logprobs): 2 + 3 * 4 = 14. Training adds, during backward, the recomputed
# exponentials, the float32 gradient and its cast back to the model dtype while the saved
# float32 logits are still held: about 22. Measured on one H200 (bf16, 4 x 1024 tokens, vocab
# 151,936, local layers): the forward-only peaks of the Qwen2.5-0.5B and 1.5B shapes imply 13.7
# and 13.4 bytes per entry, the update peaks 25.9 and 21.8 (gpu-check's memory probe).
# Since then the log-probs' backward at TP 1 reuses the saved log-softmax as the gradient
# (parallel.logprobs), so the training figure may overestimate TP 1 until re-measured.
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
