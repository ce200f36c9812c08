"""The names people coming from verl and TRL type, and rlcli's key for each: "did you mean"
looks here before it compares spellings (``actor.learning_rate`` is ``actor.lr``, not the
closest spelling ``actor.clip_ratio_c``). docs/porting-from-verl.md has the verl table in full."""

from __future__ import annotations

# verl's full keys.
VERL_KEYS = {
    "data.max_response_length": "rollout.max_tokens",
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.actor.optim.lr": "actor.lr",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "actor.lr_warmup_steps",
    "actor_rollout_ref.actor.optim.weight_decay": "actor.weight_decay",
    "actor_rollout_ref.actor.grad_clip": "actor.grad_clip",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_size",
    "actor_rollout_ref.actor.ppo_epochs": "actor.ppo_epochs",
    "actor_rollout_ref.actor.entropy_coeff": "actor.entropy_coeff",
    "actor_rollout_ref.actor.use_kl_loss": "actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef": "actor.kl_loss_coef",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "parallel.tp",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": "parallel.pp",
    "actor_rollout_ref.rollout.name": "rollout.engine",
    "actor_rollout_ref.rollout.n": "rollout.n",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.tp",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std",
    "algorithm.filter_groups.enable": "algorithm.dynamic_sampling.enabled",
    "algorithm.filter_groups.max_num_gen_batches": "algorithm.dynamic_sampling.max_gen_batches",
    "critic.optim.lr": "critic.lr",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.test_freq": "trainer.val_freq",
    "trainer.save_freq": "checkpoint.save_freq",
    "trainer.default_local_dir": "trainer.output_dir",
    "trainer.resume_mode": "trainer.resume",
    "trainer.logger": "logging.backends",
}

# A key's last part as TRL (GRPOConfig / TrainingArguments) or verl names it, whatever the
# section it is typed under: rlcli's key.
LAST_PARTS = {
    "learning_rate": "actor.lr",
    "optim.lr": "actor.lr",
    "warmup_steps": "actor.lr_warmup_steps",
    "max_grad_norm": "actor.grad_clip",
    "lr_scheduler_type": "actor.lr_decay_style",
    "num_generations": "rollout.n",
    "num_samples": "rollout.n",
    "num_return_sequences": "rollout.n",
    "temp": "rollout.temperature",
    "max_completion_length": "rollout.max_tokens",
    "max_new_tokens": "rollout.max_tokens",
    "max_response_length": "rollout.max_tokens",
    "beta": "actor.kl_loss_coef",
    "per_device_train_batch_size": "actor.micro_batch_size",
    "ppo_micro_batch_size_per_gpu": "actor.micro_batch_size",
    "num_train_epochs": "trainer.total_epochs",
    "max_steps": "trainer.total_steps",
    "total_training_steps": "trainer.total_steps",
    "save_steps": "checkpoint.save_freq",
    "eval_steps": "trainer.val_freq",
    "test_freq": "trainer.val_freq",
    "model_name_or_path": "model.path",
    "report_to": "logging.backends",
    "vllm_gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "tensor_model_parallel_size": "parallel.tp",
    # rollout correction: verl's algorithm.rollout_correction.*, TRL's vLLM importance sampling
    "rollout_is": "algorithm.off_policy_correction",
    "rollout_is_threshold": "algorithm.tis_cap",
    "rollout_rs": "algorithm.off_policy_correction",
    "vllm_importance_sampling_correction": "algorithm.off_policy_correction",
    "vllm_importance_sampling_cap": "algorithm.tis_cap",
    "use_tis": "algorithm.off_policy_correction",
    # MoE routing replay: verl's actor.router_replay.mode, slime's --use-routing-replay
    "router_replay": "model.moe_routing_replay",
    "use_routing_replay": "model.moe_routing_replay",
    "moe_enable_routing_replay": "model.moe_routing_replay",
}


def peer_name_suggestion(full_key: str, valid: set[str]) -> str | None:
    """rlcli's key for a name from verl or TRL (in the typed key's own section when that section
    has the same key, e.g. ``critic.learning_rate`` -> ``critic.lr``), None when unknown."""
    if full_key in VERL_KEYS:
        return VERL_KEYS[full_key]
    parts = full_key.split(".")
    for length in (2, 1):  # "optim.lr" before "lr"
        target = LAST_PARTS.get(".".join(parts[-length:]))
        if target is None:
            continue
        if len(parts) > length:  # typed under a section: that section's key when it has one
            same_section = f"{parts[0]}.{target.partition('.')[2]}"
            if same_section in valid:
                return same_section
        return target
    return None
