"""The checks of a config about the model's structure: its LoRA adapters (``actor.lora``), its
expert layout (``parallel.ep``, ``parallel.expert_tp``, the MoE training knobs), the latter also
against the model's config.json (``validate_against_model``, with a hybrid model's Gated
DeltaNet layers), and how an engine section holds the model (``check_hf_engine``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from rlcli.errors import UserError

if TYPE_CHECKING:
    from rlcli.config.engine import EngineConfig
    from rlcli.config.schema import RLConfig


MOE_SETTINGS = (
    "moe_load_balancing",
    "moe_aux_loss_coef",
    "moe_token_dispatcher",
    "moe_routing_replay",
)


def check_hf_engine(key: str, section: EngineConfig) -> None:
    """An engine section (``rollout``, ``reward.judge``) with ``engine=hf``: one full model."""
    if section.engine == "hf" and section.tp != 1:
        raise UserError(
            f"{key}.engine=hf runs one full model per rank; set {key}.tp=1 (got {section.tp})"
        )


def check_packing(key: str, pack_sequences: bool, cfg: RLConfig) -> None:
    """``<key>.pack_sequences`` (the actor, critic and reward model each have one) needs a core
    attention with a packed-sequence path."""
    if pack_sequences and cfg.model.attention_backend == "local":
        raise UserError(
            f"{key}.pack_sequences=true needs model.attention_backend=sdpa (or te): megatron's "
            "local attention (model.attention_backend=local) has no packed-sequence path"
        )


def check_moe_settings(cfg: RLConfig) -> None:
    if cfg.parallel.ep < 1:
        raise UserError(f"parallel.ep must be >= 1, got {cfg.parallel.ep}")
    if cfg.parallel.expert_tp is not None and cfg.parallel.expert_tp < 1:
        raise UserError(
            f"parallel.expert_tp must be >= 1 (or null: parallel.tp), got {cfg.parallel.expert_tp}"
        )
    coef = cfg.model.moe_aux_loss_coef
    if coef is not None and coef < 0:
        raise UserError(f"model.moe_aux_loss_coef must be >= 0, got {coef}")
    check_routing_replay(cfg)


def check_routing_replay(cfg: RLConfig) -> None:
    """``model.moe_routing_replay``: R2 replays the old-log-prob pass's experts in the update, so
    that pass must run, and the layouts it cannot replay exactly are refused
    (``parallel.routing_replay``). On a dense model: ``validate_against_model``."""
    replay = cfg.model.moe_routing_replay
    if replay is None:
        return
    key = f"model.moe_routing_replay={replay}"
    if replay == "r3":
        _check_engine_routing(cfg, key)
    plan = cfg.old_log_prob_plan
    if replay == "r2" and plan == "engine":
        raise UserError(
            f"{key} replays the experts of the trainer's old-log-prob pass, which "
            "actor.old_log_prob_source=engine skips: set actor.old_log_prob_source=actor, or "
            "model.moe_routing_replay=null"
        )
    if replay == "r2" and plan == "update_forward":
        raise UserError(
            f"{key} replays the old-log-prob pass's experts in the update, but this update is "
            "on-policy (actor.ppo_epochs=1, one mini-batch): its own forward is that pass and "
            "nothing changes in between. Set actor.ppo_epochs > 1 or actor.ppo_mini_batch_size "
            "below data.train_batch_size, or model.moe_routing_replay=null"
        )
    if cfg.parallel.sequence_parallel:
        raise UserError(
            f"{key} with parallel.sequence_parallel=true is not supported yet (each "
            "tensor-parallel rank routes its own slice of the tokens); set "
            "model.moe_routing_replay=null"
        )
    if cfg.parallel.pp > 1 and cfg.actor.recompute != "none":
        raise UserError(
            f"{key} with parallel.pp={cfg.parallel.pp} needs actor.recompute=none: a forward "
            "recomputed in the backward pass would replay a later micro-batch's experts"
        )


def _check_engine_routing(cfg: RLConfig, key: str) -> None:
    """R3 reads the experts the engine routed every token to: the HF engine reads them (vLLM
    returns them only from its GPU model runner, not wired yet), for single-turn samples whose
    tokens the engine read in one sequence, on one pipeline stage (the engine's layers are all
    the trainer's)."""
    r = cfg.rollout
    if r.engine != "hf":
        raise UserError(
            f"{key} needs rollout.engine=hf (the {r.engine} engine does not return the experts "
            "it routed to); or use model.moe_routing_replay=r2"
        )
    if r.multi_turn.enable or r.agent is not None:
        raise UserError(
            f"{key} replays the engine's experts of single-turn samples: turn off "
            "rollout.multi_turn.enable / rollout.agent, or use model.moe_routing_replay=r2"
        )
    if r.is_separate:
        raise UserError(f"{key} needs rollout.placement=colocated (not built for separate yet)")
    if cfg.parallel.pp > 1:
        raise UserError(
            f"{key} needs parallel.pp=1 (the engine's routing covers every layer; a pipeline "
            "stage's share of it is not cut out yet)"
        )


def validate_against_model(cfg: RLConfig, model_config: dict[str, Any]) -> None:
    """The settings that depend on the model (`model_config`: its config.json): MoE settings
    on a dense model, an expert layout the experts do not split into, MoE at TP > 1 without
    sequence parallelism (megatron-core's MoE layer refuses to train so)."""
    from parallel.model_shapes import num_experts_of

    check_linear_attention(cfg, model_config)
    check_vision_language(cfg, model_config)
    par, experts = cfg.parallel, num_experts_of(model_config)
    model = f"{model_config.get('model_type')!r} model"
    if not experts:
        given = [f"model.{key}" for key in MOE_SETTINGS if getattr(cfg.model, key) is not None]
        given += [
            f"parallel.{key}" for key in ("ep", "expert_tp") if getattr(par, key) not in (None, 1)
        ]
        if given:
            raise UserError(
                f"{', '.join(given)}: the {model} has no experts (config.json num_experts); "
                "these settings are for mixture-of-experts models: remove them"
            )
        return
    if experts % par.ep:
        raise UserError(f"parallel.ep={par.ep} must divide the {model}'s {experts} experts")
    width = int(model_config.get("moe_intermediate_size") or 0)
    if width and width % (par.expert_tp or par.tp):
        raise UserError(
            f"parallel.expert_tp={par.expert_tp or par.tp} must divide the experts' width "
            f"{width} (config.json moe_intermediate_size)"
        )
    if par.tp > 1 and not par.sequence_parallel:
        raise UserError(
            f"parallel.tp={par.tp} with a mixture-of-experts model needs "
            "parallel.sequence_parallel=true (megatron-core's MoE layer trains tensor-parallel "
            "only with sequence parallelism, which needs Transformer Engine); or set "
            "parallel.tp=1 and spread the experts with parallel.ep"
        )
    if cfg.actor.lora.enable:
        from rlcli.model.lora import lora_spec

        check_lora(cfg)  # the target names themselves
        mlp = {"linear_fc1", "linear_fc2"} & set(lora_spec(cfg.actor.lora, 0).targets())
        if mlp:
            raise UserError(
                f"actor.lora.target_modules: the {model}'s MLPs are routed experts, which take "
                f"no LoRA adapters ({', '.join(sorted(mlp))}); set actor.lora.target_modules="
                "[linear_qkv,linear_proj]"
            )


def check_vision_language(cfg: RLConfig, model_config: dict[str, Any]) -> None:
    """A vision-language policy (Qwen2.5-VL) trains with GRPO-style algorithms, colocated,
    single-turn, its tower frozen or trained (docs/vision-language.md); what is not built for it
    yet is refused rather than run as a silently text-only model."""
    if "vision_config" not in model_config:
        if not cfg.model.freeze_vision_tower:
            raise UserError(
                f"model.freeze_vision_tower=false: the {model_config.get('model_type')!r} model "
                "has no vision tower to train; remove the setting"
            )
        return
    model = f"the vision-language model ({model_config.get('model_type')!r})"
    unsupported = {
        "algorithm.adv_estimator=gae": cfg.algorithm.uses_critic,
        "rollout.multi_turn.enable": cfg.rollout.multi_turn.enable,
        "rollout.agent": cfg.rollout.agent is not None,
        "rollout.placement=separate": cfg.rollout.is_separate,
        "distill.enable": cfg.distill.enable,
        "actor.lora.enable": cfg.actor.lora.enable,
        "actor.pack_sequences": cfg.actor.pack_sequences,
        "parallel.sequence_parallel": cfg.parallel.sequence_parallel,
    }
    if not cfg.model.freeze_vision_tower:
        unsupported["model.freeze_vision_tower=false with parallel.pp > 1"] = cfg.parallel.pp > 1
    given = [key for key, on in unsupported.items() if on]
    if given:
        raise UserError(
            f"{', '.join(given)}: not built for {model} yet (it trains as the policy, "
            "colocated, single-turn, in padded micro-batches, without a critic, teacher or "
            "LoRA; a trained tower without pipeline stages); change these settings, or train a "
            "text model"
        )


def check_linear_attention(cfg: RLConfig, model_config: dict[str, Any]) -> None:
    """A hybrid model's Gated DeltaNet layers (Qwen3.5; `model.spec.architecture=qwen3_5`
    builds one): what megatron-core's DeltaNet and the CPU engines cannot take. (LoRA adapts
    the attention layers and the MLPs and leaves the DeltaNets alone: `parallel.lora`.)"""
    layer_types = model_config.get("layer_types") or []
    if "linear_attention" not in layer_types and model_config.get("model_type") != "qwen3_5":
        return
    model = "this model's Gated DeltaNet (linear-attention) layers"
    for key, section in (("actor", cfg.actor), ("critic", cfg.critic)):
        if section.pack_sequences:
            raise UserError(
                f"{key}.pack_sequences=true cannot serve {model}: megatron-core's DeltaNet has "
                f"no packed-sequence path here; set {key}.pack_sequences=false"
            )
    engine_dtype = cfg.rollout.engine_dtype(cfg.model.dtype)
    if cfg.rollout.engine == "vllm" and not _has_cuda() and engine_dtype != "bfloat16":
        raise UserError(
            f"rollout.dtype={engine_dtype}: vLLM's CPU engine runs {model} only in bfloat16 "
            "(its CPU DeltaNet kernel); set rollout.dtype=bfloat16 (the trainer may stay in "
            "float32: the mismatch then shows in rollout/mismatch_*), or rollout.engine=hf"
        )
    for key in ("linear_num_key_heads", "linear_num_value_heads"):
        heads = model_config.get(key)
        if heads and heads % cfg.parallel.tp:
            raise UserError(
                f"parallel.tp={cfg.parallel.tp} must divide the model's {heads} "
                f"linear-attention heads (config.json {key})"
            )


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_lora(cfg: RLConfig) -> None:
    """``actor.lora`` and ``rollout.lora_sync``: the adapters' settings (rank, alpha, dropout,
    target modules: ``parallel.lora``'s own checks), the layers they need, the starting adapter's
    folder, and an engine that can take adapters. Whether the adapter fits the model is checked
    when it loads (``parallel.lora_io.load_peft_adapter``), against the model's shapes."""
    lora, rollout = cfg.actor.lora, cfg.rollout
    if not lora.enable:
        if rollout.lora_sync == "adapter":
            raise UserError(
                "rollout.lora_sync=adapter syncs LoRA adapters, but actor.lora.enable=false: "
                "set actor.lora.enable=true or rollout.lora_sync=merged"
            )
        return
    from parallel.lora import LoraConfigError
    from rlcli.model.lora import lora_spec

    try:
        lora_spec(lora, cfg.trainer.seed).targets()
    except LoraConfigError as err:
        raise UserError(str(err)) from None
    if rollout.lora_sync == "adapter" and rollout.engine != "vllm":
        raise UserError(
            f"rollout.lora_sync=adapter: the {rollout.engine} engine cannot apply LoRA adapters "
            "(only rollout.engine=vllm can); set rollout.lora_sync=merged"
        )
    if cfg.parallel.sequence_parallel:
        raise UserError(
            "actor.lora: the adapters do not support sequence-parallel linears; set "
            "parallel.sequence_parallel=false"
        )
    if cfg.model.transformer_impl == "transformer_engine":
        raise UserError(
            "actor.lora needs megatron's local layers (Transformer Engine fuses the norm into "
            "the linear the adapter reads): set model.transformer_impl=local"
        )
    if lora.adapter_path is not None and not os.path.isdir(lora.adapter_path):
        raise UserError(
            f"actor.lora.adapter_path={lora.adapter_path!r}: no such folder (a PEFT adapter "
            "folder holds adapter_config.json and adapter_model.safetensors)"
        )
