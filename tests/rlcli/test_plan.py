"""`rlcli plan` and parallel.memory_plan: the done-when layouts, bad input, and the formulas against
independent counts (transformers' own parameter count, megatron's bytes-per-parameter table).
The per-rank counts against real megatron models at TP1 / TP2 / PP2 / DP2 are in
tests/parallel/offload_worker.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from parallel.memory_plan import PlanInputs, RolloutEngine, plan_memory
from parallel.memory_terms import (
    GB,
    TrainedModel,
    activation_bytes,
    grad_bytes,
    optimizer_bytes,
    weight_bytes,
)
from parallel.model_shapes import KNOWN_SHAPES, max_stage_params
from rlcli.cli import main

SEVEN_B = ["plan", "recipes/grpo_qwen7b.yaml", "--nodes", "2", "--gpus-per-node", "8"]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as exit_:
        code = exit_.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-32b", "llama-3-8b"])
def test_known_shapes_count_what_transformers_builds(name):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = KNOWN_SHAPES[name]
    config_cls, model_cls = (
        (LlamaConfig, LlamaForCausalLM) if "llama" in name else (Qwen2Config, Qwen2ForCausalLM)
    )
    config = config_cls(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.ffn,
        vocab_size=shape.vocab,
        tie_word_embeddings=shape.tied,
    )
    with torch.device("meta"):
        model = model_cls(config)
    hf_count = sum(p.numel() for p in model.parameters())  # tied weights counted once
    assert max_stage_params(shape, tp=1, pp=1) == hf_count


@pytest.mark.parametrize(
    "dtype, distributed, dp, per_param",
    [  # megatron-core distributed optimizer docs, bytes per parameter (fp32 grad buffer)
        ("bfloat16", False, 4, 18),
        ("bfloat16", True, 4, 6 + 12 / 4),
        ("float32", False, 8, 16),
        ("float32", True, 8, 8 + 8 / 8),
    ],
)
def test_training_state_bytes_per_parameter(dtype, distributed, dp, per_param):
    model = TrainedModel(
        KNOWN_SHAPES["qwen2.5-7b"], dtype=dtype, tp=4, dp=dp, distributed_optimizer=distributed
    )
    total = weight_bytes(model) + grad_bytes(model) + optimizer_bytes(model)
    assert total == pytest.approx(per_param * model.params, abs=16)


def test_recompute_and_offload_lower_their_phases():
    actor = TrainedModel(KNOWN_SHAPES["qwen2.5-7b"], tp=4, dp=4, micro_batch_size=4, seq_len=2048)
    none, selective, full = (
        activation_bytes(dataclasses.replace(actor, recompute=m, attention="local"))
        for m in ("none", "selective", "full")
    )
    assert none > selective > full
    inputs = PlanInputs(actor, RolloutEngine(tp=2), 80 * GB, ref=True)
    plain = plan_memory(inputs)
    offloaded_actor = dataclasses.replace(
        actor, offload_params=True, offload_grads=True, offload_optimizer=True
    )
    offloaded = plan_memory(dataclasses.replace(inputs, actor=offloaded_actor, ref_offload=True))
    state = weight_bytes(actor) * 2 + grad_bytes(actor) + optimizer_bytes(actor)  # + ref weights
    gen_saving = plain.phases["generate"].total - offloaded.phases["generate"].total
    assert gen_saving == state
    assert offloaded.phases["update"].total == plain.phases["update"].total - weight_bytes(actor)


def test_activations_follow_the_core_attention():
    """No s^2 score tensor with sdpa or TE; the local layers' fp32 norm copies cost more than TE's
    fused norms; packing counts the budget's tokens as one row."""
    from rlcli.commands.plan import build_plan_inputs
    from rlcli.config_loader import load_config

    actor = TrainedModel(KNOWN_SHAPES["qwen2.5-7b"], tp=4, micro_batch_size=2, seq_len=4096)
    te, sdpa, local = (
        activation_bytes(dataclasses.replace(actor, attention=a)) for a in ("te", "sdpa", "local")
    )
    assert te < sdpa < local
    longer = dataclasses.replace(actor, seq_len=8192, micro_batch_size=1)
    # same tokens: linear without the score tensor, more than linear with it
    assert activation_bytes(dataclasses.replace(longer, attention="sdpa")) == pytest.approx(
        sdpa, rel=1e-3
    )
    assert activation_bytes(dataclasses.replace(longer, attention="local")) > 1.3 * local

    def planned(*overrides):
        cfg = load_config("recipes/grpo_qwen7b.yaml", list(overrides))
        return build_plan_inputs(cfg, KNOWN_SHAPES["qwen2.5-7b"], world_size=16, gpu_memory_gb=80)

    assert planned("model.attention_backend=local").actor.attention == "local"
    assert planned("model.transformer_impl=local").actor.attention == "sdpa"
    packed = planned("actor.pack_sequences=true", "actor.max_tokens_per_micro_batch=16384").actor
    assert (packed.micro_batch_size, packed.seq_len) == (1, 16384)


def test_a_critic_is_one_more_trained_model():
    actor = TrainedModel(KNOWN_SHAPES["qwen2.5-7b"], tp=4, dp=4)
    critic = dataclasses.replace(actor, critic=True)
    inputs = PlanInputs(actor, RolloutEngine(tp=2), 80 * GB)
    with_critic = plan_memory(dataclasses.replace(inputs, critic=critic))
    update = with_critic.phases["update"].terms
    assert update["critic weights"] == weight_bytes(critic) < weight_bytes(actor)
    assert with_critic.phases["update"].total - plan_memory(inputs).phases["update"].total == (
        weight_bytes(critic) + grad_bytes(critic) + optimizer_bytes(critic)
    )


def test_the_critic_is_planned_with_its_own_micro_batches():
    from rlcli.commands.plan import build_plan_inputs
    from rlcli.config_loader import load_config

    recipe = "recipes/ppo_qwen7b.yaml"  # tests run from the repository root, as SEVEN_B does
    shape = KNOWN_SHAPES["qwen2.5-7b"]

    def critic_of(*overrides):
        cfg = load_config(recipe, list(overrides))
        inputs = build_plan_inputs(cfg, shape, world_size=16, gpu_memory_gb=80)
        return inputs.actor, inputs.critic

    actor, critic = critic_of("actor.micro_batch_size=2", "critic.micro_batch_size=8")
    assert (actor.micro_batch_size, critic.micro_batch_size) == (2, 8)
    assert critic.num_micro_batches * 4 == actor.num_micro_batches
    assert (critic.tp, critic.pp, critic.dp) == (actor.tp, actor.pp, actor.dp)


def test_7b_recipe_fits_on_two_nodes_of_80gb(capsys):
    code, out, _ = run_cli(capsys, *SEVEN_B, "--gpu-memory-gb", "80")
    assert code == 0, out
    for phase in ("generate", "log_probs", "update", "sync"):
        assert phase in out
    assert "actor optimizer" in out and "vLLM KV cache" in out
    assert "-> fits" in out


def test_7b_at_tp1_without_distributed_optimizer_does_not_fit_and_names_a_fix(capsys):
    overrides = ["parallel.tp=1", "parallel.use_distributed_optimizer=false"]
    code, out, _ = run_cli(capsys, *SEVEN_B, *overrides, "--gpu-memory-gb", "80")
    assert code == 1
    assert "does NOT fit" in out
    assert "smallest change that fits: parallel.tp=" in out


def test_32b_layout_gets_a_recommendation(capsys):
    code, out, _ = run_cli(
        capsys,
        "plan",
        "recipes/grpo_qwen7b.yaml",
        "model.path=/models/Qwen2.5-32B-Instruct",
        "model.attention_backend=te",  # a cluster with Transformer Engine
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
    )
    assert "known shape for 'Qwen2.5-32B-Instruct'" in out
    assert code == 1 and "smallest change that fits:" in out


def test_quickstart_plans_from_its_built_spec(capsys, tmp_path):
    # A fresh output folder: after `make demo` the built model's config.json would answer first.
    output = f"trainer.output_dir={tmp_path}"
    code, out, _ = run_cli(
        capsys, "plan", "recipes/quickstart.yaml", output, "--gpus-per-node", "1"
    )
    assert code == 0 and "model.spec (built locally)" in out


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["model.path=/models/NoSuchModel"], "--model-config"),
        (["parallel.tp=8"], "key/value heads"),
        (["parallel.tp=3"], "not divisible"),
        (["actor.recompute=sometimes"], "actor.recompute"),
        (["--nodes", "0"], "--nodes"),
        (["--model-config", "/nonexistent/config.json"], "--model-config"),
    ],
)
def test_bad_input_is_a_user_error(capsys, extra, needle):
    code, _, err = run_cli(capsys, *SEVEN_B, *extra)
    assert code == 2 and needle in err, err
