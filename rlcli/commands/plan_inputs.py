"""What ``rlcli plan`` computes its memory plan from: the models' shapes (the policy's, the
reward model's, the judge's) and ``parallel.memory_plan``'s inputs for a recipe's layout."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from rlcli.errors import UserError

GB = 1024**3


def shape_of_config(file: Path):
    """The model shape of a config.json; of a multimodal checkpoint's language model (what
    rlcli trains of it, `rlcli convert language-model`) for one."""
    from parallel.convert.language_model import text_settings
    from parallel.convert.registry import language_model_type
    from parallel.model_shapes import ModelShape

    config = json.loads(file.read_text())
    if language_model_type(config) is not None:
        config = text_settings(config)
    elif "vision_config" in config:
        return vision_language_shape(config)
    return ModelShape.from_hf_config(config)


def vision_language_shape(config: dict):
    """A Qwen2.5-VL config.json's shape: its language model (``text_config``, or the top level
    as the released checkpoints write it) and its vision tower (``parallel.vision_shape``)."""
    import dataclasses

    from parallel.model_shapes import ModelShape
    from parallel.vision_shape import VisionShape

    if config.get("model_type") != "qwen2_5_vl":
        raise UserError(
            f"a vision-language model of type {config.get('model_type')!r}: rlcli plan counts "
            "Qwen2.5-VL's vision tower only"
        )
    text = {**config, **(config.get("text_config") or {}), "model_type": "qwen2"}
    shape = ModelShape.from_hf_config(text)
    vision = VisionShape.from_vision_config(config["vision_config"], shape.hidden)
    return dataclasses.replace(shape, vision=vision)


def model_shape(cfg, model_config: Optional[Path]):
    """(shape, where it came from): --model-config, the recipe's config.json, model.build's spec,
    or the table of known shapes keyed by model.path's basename."""
    from parallel.model_shapes import KNOWN_SHAPES, ModelShape, known_shape

    candidates = [model_config] if model_config else []
    if cfg.model.path:
        candidates.append(Path(cfg.model.path))
    for path in candidates:
        file = path / "config.json" if path.is_dir() else path
        if file.is_file():
            try:
                return shape_of_config(file), str(file)
            except (KeyError, ValueError) as err:
                raise UserError(f"{file}: not an HF model config ({err})") from None
        if path is model_config:
            raise UserError(f"--model-config {path}: no such config.json")
    if cfg.model.build:
        from rlcli.model.builder import hybrid_layers

        spec = cfg.model.spec
        model_type = {"qwen3_5": "qwen3_5_text", "qwen2_5_vl": "qwen2"}.get(
            spec.architecture, spec.architecture
        )
        config = {
            "model_type": model_type,
            "hidden_size": spec.hidden_size,
            "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads,
            "intermediate_size": spec.intermediate_size,
            "vocab_size": spec.vocab_size,
            "tie_word_embeddings": spec.tie_word_embeddings,
            **hybrid_layers(spec),  # Qwen3.5's Gated DeltaNet layers, as the builder lays them
        }
        shape = ModelShape.from_hf_config(config)
        if spec.architecture == "qwen2_5_vl":
            from rlcli.model.vision_builder import vision_shape

            shape = dataclasses.replace(shape, vision=vision_shape(spec))
        return shape, "model.spec (built locally)"
    shape = known_shape(cfg.model.path)
    if shape is None:
        raise UserError(
            f"model shape unknown: {cfg.model.path}/config.json does not exist and "
            f"'{Path(cfg.model.path).name}' is not a known shape ({', '.join(KNOWN_SHAPES)}); "
            "pass --model-config path/to/config.json"
        )
    return shape, f"known shape for '{Path(cfg.model.path).name}'"


def _other_model_shape(key: str, path: str, fallback=None):
    """The shape of another model of the run (``reward.model.path``, ``reward.judge.path``,
    ``distill.teacher_path``): its config.json, the table of known shapes, or `fallback` (a reward
    model still to be trained from the policy has the policy's shape)."""
    from parallel.model_shapes import KNOWN_SHAPES, known_shape

    file = Path(path) / "config.json"
    if file.is_file():
        try:
            return shape_of_config(file)
        except (KeyError, ValueError) as err:
            raise UserError(f"{key}={path}: {file} is not an HF model config ({err})") from None
    shape = known_shape(path) or fallback
    if shape is None:
        raise UserError(
            f"{key}={path}: model shape unknown ({file} does not exist and "
            f"'{Path(path).name}' is not a known shape: {', '.join(KNOWN_SHAPES)})"
        )
    return shape


def planned_attention(cfg) -> str:
    """The core attention whose activations the plan counts: model.attention_backend, auto as a
    run here resolves it (TE's where TE imports, else sdpa) unless transformer_impl pins it."""
    from parallel.model_backends import transformer_engine_status

    if cfg.model.attention_backend != "auto":
        return cfg.model.attention_backend
    if cfg.model.transformer_impl != "auto":
        return "te" if cfg.model.transformer_impl == "transformer_engine" else "sdpa"
    return "te" if transformer_engine_status()[0] else "sdpa"


def micro_batch_shape(rows: int, budget: int, packed: bool, seq_len: int) -> tuple[int, int]:
    """(rows, tokens per row) of the largest training micro-batch: `rows` of the longest sequence;
    with a token budget as many as it holds; packed, one row of the budget (0: rows x seq_len)."""
    if packed:
        return 1, budget or rows * seq_len
    if budget:
        return max(1, budget // seq_len), seq_len
    return rows, seq_len


def build_plan_inputs(cfg, shape, *, world_size: int, gpu_memory_gb: float):
    """parallel.memory_plan's inputs for a validated RLConfig on `world_size` GPUs."""
    from parallel.memory_plan import JudgeEngine, PlanInputs, RolloutEngine
    from parallel.memory_terms import TrainedModel
    from parallel.reshard import AUTO_BUCKET_MB
    from rlcli.config.schema import mini_batch_count
    from rlcli.model.lora import lora_spec
    from rlcli.validation.model import validate_against_model
    from rlcli.validation.placement import trainer_ranks
    from rlcli.validation.validate import derive_dp, validate

    validate(cfg, world_size=world_size)
    par = cfg.parallel
    dp = derive_dp(par, trainer_ranks(cfg, world_size))
    known = {"num_experts": shape.experts, "moe_intermediate_size": shape.moe_ffn}
    if shape.vision is not None:
        known["vision_config"] = dataclasses.asdict(shape.vision)
    validate_against_model(cfg, {"model_type": Path(cfg.model.path).name, **known})
    if shape.kv_heads % par.tp:
        raise UserError(
            f"parallel.tp={par.tp} must divide the model's {shape.kv_heads} key/value heads"
        )
    if shape.layers % (par.pp * (par.vpp or 1)):
        raise UserError(
            f"{shape.layers} layers cannot be split over parallel.pp * parallel.vpp = "
            f"{par.pp * (par.vpp or 1)} stages"
        )
    seq_len = cfg.data.max_prompt_length + cfg.rollout.max_tokens
    sequences = cfg.data.train_batch_size * cfg.rollout.n

    lora = lora_spec(cfg.actor.lora, cfg.trainer.seed)

    def trained(section, critic: bool = False) -> TrainedModel:
        """The memory terms of the model an ``actor`` / ``critic`` section trains: the run's
        layout, the section's micro-batches per optimizer step, recomputation and offloading
        (the actor's LoRA adapters: only they have gradients and optimizer state)."""
        adapters = lora if not critic else None
        prompts = cfg.data.train_batch_size
        mini = prompts // mini_batch_count(prompts, section.ppo_mini_batch_size) * cfg.rollout.n
        rows, tokens = micro_batch_shape(
            section.micro_batch_size,
            section.max_tokens_per_micro_batch,
            section.pack_sequences,
            seq_len,
        )
        return TrainedModel(
            shape,
            dtype=cfg.model.dtype,
            tp=par.tp,
            pp=par.pp,
            vpp=par.vpp,
            dp=dp,
            distributed_optimizer=par.use_distributed_optimizer,
            micro_batch_size=rows,
            seq_len=tokens,
            num_micro_batches=max(1, mini // dp // section.micro_batch_size),
            recompute=section.recompute,
            recompute_method=section.recompute_method,
            recompute_num_layers=section.recompute_num_layers,
            sequence_parallel=par.sequence_parallel,
            attention=planned_attention(cfg),
            offload_params=section.offload_params,
            offload_grads=section.offload_grads,
            offload_optimizer=section.offload_optimizer,
            critic=critic,
            train_vision_tower=not critic and not cfg.model.freeze_vision_tower,
            ep=par.ep,
            etp=par.expert_tp,
            lora_rank=adapters.rank if adapters is not None else 0,
            lora_target_modules=adapters.targets() if adapters is not None else (),
        )

    actor = trained(cfg.actor)
    engines = (cfg.rollout.num_ranks if cfg.rollout.is_separate else world_size) // cfg.rollout.tp
    rollout = RolloutEngine(
        tp=cfg.rollout.tp,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        max_model_len=cfg.rollout.max_model_len or seq_len,
        sequences=-(-sequences // engines),
        dtype=cfg.rollout.engine_dtype(cfg.model.dtype),
        sync_bucket_bytes=(cfg.rollout.sync_bucket_mb or AUTO_BUCKET_MB) * 1024**2,
    )
    critic = trained(cfg.critic, critic=True) if cfg.algorithm.uses_critic else None
    reward_model = judge = None
    if cfg.reward.model.path:  # frozen, in the actor's layout, scoring whole sequences
        rm_shape = _other_model_shape(
            "reward.model.path", cfg.reward.model.path, shape if cfg.rm.before_rl else None
        )
        reward_model = dataclasses.replace(
            actor,
            shape=rm_shape,
            micro_batch_size=cfg.reward.model.micro_batch_size,
            critic=True,
            head_bias=False,
            lora_rank=0,  # frozen: no adapters, gradients or optimizer state of its own
            lora_target_modules=(),
        )
    j = cfg.reward.judge
    if j.path:
        judge = JudgeEngine(
            _other_model_shape("reward.judge.path", j.path),
            vllm=j.engine == "vllm",
            tp=j.tp,
            gpu_memory_utilization=j.gpu_memory_utilization,
            dtype=cfg.model.dtype,
        )
    teacher = None
    # (a teacher on an engine of its own is not planned: like a judge's vLLM, a budget of its own)
    if cfg.distill.enable and cfg.distill.teacher_path and cfg.distill.teacher.engine == "megatron":
        teacher = dataclasses.replace(
            actor,
            shape=_other_model_shape("distill.teacher_path", cfg.distill.teacher_path),
            lora_rank=0,  # frozen: no adapters, gradients or optimizer state of its own
            lora_target_modules=(),
        )
    return PlanInputs(
        actor=actor,
        rollout=rollout,
        gpu_memory_bytes=int(gpu_memory_gb * GB),
        # a LoRA actor's reference is the actor itself, adapters off: no weights of its own
        ref=(cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and lora is None,
        ref_offload=cfg.ref.offload,
        critic=critic,
        separate=cfg.rollout.is_separate,
        reward_model=reward_model,
        reward_model_offload=cfg.reward.model.offload,
        judge=judge,
        teacher=teacher,
        teacher_offload=cfg.distill.offload,
        rollout_vllm=cfg.rollout.engine == "vllm",
    )
