"""Per-GPU memory of an RL layout: each phase of one RL step, from the training-state terms of
`parallel.memory_terms` and the rollout engine's weights and KV cache. Colocated: every GPU holds
both, phase by phase. Separate (`PlanInputs.separate`): the trainer's GPUs hold no engine, and
each rollout GPU holds only its engine and the sync bucket it receives (`MemoryPlan.rollout_rank`).

Pure arithmetic on a model shape and a layout; nothing here allocates or imports megatron.

    shape = ModelShape.from_hf_config(json.load(open("config.json")))
    plan = plan_memory(PlanInputs(actor=TrainedModel(shape, tp=4, dp=4, ...), ...))
    plan.phases["update"].total, plan.peak_phase, plan.fits

Model rewards add a ``reward`` phase between generate and log_probs (only when there are any): a
frozen reward model (``PlanInputs.reward_model``, the actor's layout, its own shape) holds its
weights in every phase unless offloaded, and its forward working set in ``reward``; a judge
engine (``PlanInputs.judge``) holds its memory while awake. vLLM's sleep-mode allocator
(vllm/device_allocator/cumem.py, ``CuMemAllocator``) is one per process, and an engine's
sleep / wake acts on every allocation made through it: a vLLM judge next to a vLLM rollout engine
wakes with it (generate, and its weights in sync) and wakes it (reward). An HF judge never
sleeps: its weights stay in every phase.

Sources: the training-state terms (weights, gradients, Adam, activations, logits) are
`parallel.memory_terms`, with theirs ([ZeRO], [MCORE], [KORT]); the engine's:
  [VLLM]  vLLM's KV cache: 2 (K and V) * num_layers * (kv_heads / tp) * head_dim * dtype bytes per
          token (vllm/v1/kv_cache_interface.py, AttentionSpec.page_size_bytes), inside the budget
          gpu_memory_utilization * total memory minus its weights and activation peak
          (vllm/v1/worker/gpu_worker.py, determine_available_memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallel.memory_terms import (
    DTYPE_BYTES,
    GB,
    TrainedModel,
    activation_bytes,
    forward_only_bytes,
    grad_bytes,
    optimizer_bytes,
    weight_bytes,
)
from parallel.model_shapes import ModelShape, max_stage_params

PHASES = ("generate", "reward", "log_probs", "update", "sync")
# CUDA context, NCCL communicators and allocator slack, per GPU (in no formula here or in
# parallel.memory_terms; a
# measured-order-of-magnitude reserve so "fits" does not mean "fits with 0 bytes to spare").
RUNTIME_RESERVE_BYTES = int(2.0 * GB)


@dataclass(frozen=True)
class RolloutEngine:
    tp: int = 1
    gpu_memory_utilization: float = 0.5
    max_model_len: int = 1024
    sequences: int = 1  # concurrent sequences one engine is asked for (prompts * n)
    dtype: str = "bfloat16"
    sync_bucket_bytes: int = 512 * 1024**2


@dataclass(frozen=True)
class JudgeEngine:
    """A generative judge's engine: vLLM (a memory budget, asleep outside the reward phase) or
    HF transformers (its weights, always resident)."""

    shape: ModelShape
    vllm: bool = True
    tp: int = 1
    gpu_memory_utilization: float = 0.5
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class PlanInputs:
    actor: TrainedModel
    rollout: RolloutEngine
    gpu_memory_bytes: int
    ref: bool = False  # a frozen reference model with the actor's shape and layout
    ref_offload: bool = False
    critic: TrainedModel | None = None
    separate: bool = False  # engines on GPUs of their own (rollout.placement=separate)
    reward_model: TrainedModel | None = None  # frozen (reward.model); critic=True, no head bias
    reward_model_offload: bool = False
    judge: JudgeEngine | None = None
    # on-policy distillation's frozen teacher (the actor's layout, its own shape): its weights in
    # the log-prob phase, and in every phase unless offloaded
    teacher: TrainedModel | None = None
    teacher_offload: bool = False
    rollout_vllm: bool = True  # the rollout engine is vLLM (it shares the judge's allocator)


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
    rollout_rank: Phase | None = None  # separate: what a rollout GPU holds (its engine)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: self.phases[name].total)

    @property
    def peak(self) -> int:
        return self.phases[self.peak_phase].total

    @property
    def fits(self) -> bool:
        limit = self.inputs.gpu_memory_bytes
        rollout_fits = self.rollout_rank is None or self.rollout_rank.total <= limit
        return self.peak <= limit and self.kv_cache > 0 and rollout_fits


def vllm_weight_bytes(shape: ModelShape, rollout: RolloutEngine) -> int:
    # vLLM splits a MoE model's experts over its TP ranks too (FusedMoE, no expert parallelism)
    full = max_stage_params(shape, tp=rollout.tp, pp=1, etp=rollout.tp)
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


def _model_reward_terms(inputs: PlanInputs) -> dict[str, dict[str, int]]:
    """Each phase's bytes of the reward model and the judge (module docstring)."""
    terms: dict[str, dict[str, int]] = {phase: {} for phase in PHASES}
    rm = inputs.reward_model
    if rm is not None:
        for phase in PHASES:
            if phase == "reward" or not inputs.reward_model_offload:
                terms[phase]["reward model weights"] = weight_bytes(rm)
        terms["reward"]["reward model forward"] = forward_only_bytes(rm, rm.micro_batch_size)
    judge = inputs.judge
    if judge is not None:
        weights = max_stage_params(judge.shape, tp=judge.tp, pp=1) * DTYPE_BYTES[judge.dtype]
        if not judge.vllm:
            for phase in PHASES:
                terms[phase]["judge weights (HF)"] = weights
        else:
            budget = int(judge.gpu_memory_utilization * inputs.gpu_memory_bytes)
            terms["reward"]["judge vLLM (gpu_memory_utilization)"] = budget
            if inputs.rollout_vllm:  # one allocator: asleep and awake with the rollout engine
                terms["generate"]["judge vLLM (gpu_memory_utilization)"] = budget
                terms["sync"]["judge vLLM weights"] = weights
    return terms


def plan_memory(inputs: PlanInputs) -> MemoryPlan:
    """Bytes per GPU of each phase of one RL step (see the module docstring); with
    ``inputs.separate`` the phases are the trainer GPUs' and ``rollout_rank`` the engines'."""
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
    frozen_idle = {"ref weights": ref_weights} if ref_weights and not inputs.ref_offload else {}
    teacher = inputs.teacher
    teacher_weights = weight_bytes(teacher) if teacher is not None else 0
    if teacher_weights and not inputs.teacher_offload:
        frozen_idle["teacher weights"] = teacher_weights

    def idle(**onloaded: bool) -> dict[str, int]:
        terms: dict[str, int] = {}
        for model, prefix in models:
            terms.update(_resident(model, prefix, **onloaded))
        return terms

    engine = {} if inputs.separate else {"vLLM (gpu_memory_utilization)": vllm_budget}
    generate = {**idle(params=False, grads=False, opt=False), **frozen_idle, **engine, **reserve}
    scorers = [m for m, _ in models] + ([teacher] if teacher is not None else [])
    fwd = max(forward_only_bytes(m, m.micro_batch_size) for m in scorers)
    log_probs = {
        **idle(params=True, grads=False, opt=False),
        "ref weights": ref_weights,
        # both counted: with both offloaded only one is ON at a time (an overestimate then)
        "teacher weights": teacher_weights,
        "forward working set": fwd,
        **reserve,
    }
    # Woken for its phase, a vLLM judge wakes a vLLM rollout engine too (one allocator).
    rollout_awake = inputs.judge is not None and inputs.judge.vllm and inputs.rollout_vllm
    reward = {
        **idle(params=False, grads=False, opt=False),
        **frozen_idle,
        **({"vLLM (gpu_memory_utilization)": vllm_budget} if rollout_awake else {}),
        **reserve,
    }
    update = {**idle(params=True, grads=True, opt=True), **frozen_idle, **reserve}
    # the critic updates before the actor, one after the other: the larger activation peak counts
    update["activations"] = max(activation_bytes(m) for m, _ in models)
    sync = {
        **idle(params=True, grads=False, opt=False),
        **frozen_idle,
        **({} if inputs.separate else {"vLLM weights": vllm_weights}),
        "sync buckets": 2 * rollout.sync_bucket_bytes,
        **reserve,
    }
    rollout_rank = None
    if inputs.separate:  # the engine, and the bucket being received and the one being loaded
        rollout_rank = Phase(
            {
                "vLLM (gpu_memory_utilization)": vllm_budget,
                "sync buckets": 2 * rollout.sync_bucket_bytes,
                **reserve,
            }
        )
    extra = _model_reward_terms(inputs)
    rows = dict(zip(PHASES, (generate, reward, log_probs, update, sync), strict=True))
    if inputs.reward_model is None and inputs.judge is None:
        del rows["reward"]
    phases = {
        name: Phase({k: v for k, v in {**terms, **extra[name]}.items() if v})
        for name, terms in rows.items()
    }
    components = {
        **{k: v for m, p in models for k, v in _trained_terms(m, p).items()},
        "actor optimizer (distributed)": optimizer_bytes(actor, distributed=True),
        "actor optimizer (not distributed)": optimizer_bytes(actor, distributed=False),
        "activations (largest micro-batch)": activation_bytes(actor),
        "ref weights": ref_weights,
        "teacher weights": teacher_weights,
        "vLLM weights": vllm_weights,
        "vLLM KV cache": max(kv_cache, 0),
    }
    if inputs.reward_model is not None:
        components["reward model weights"] = weight_bytes(inputs.reward_model)
    return MemoryPlan(inputs, components, phases, vllm_weights, kv_cache, kv_needed, rollout_rank)
