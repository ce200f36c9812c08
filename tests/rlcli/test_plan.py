"""`rlcli plan` and parallel.memory_plan: the done-when layouts, bad input, and the formulas against
independent counts (transformers' own parameter count, megatron's bytes-per-parameter table).
The per-rank counts against real megatron models at TP1 / TP2 / PP2 / DP2 are in
tests/parallel/offload_worker.py."""

from __future__ import annotations

import dataclasses
import re

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


def _hf_config(shape):
    """A transformers config of `shape`'s family (Llama, Qwen2, Qwen3, Qwen3-MoE)."""
    import transformers

    options = dict(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.ffn,
        vocab_size=shape.vocab,
        tie_word_embeddings=shape.tied,
    )
    if shape.qk_norm:
        options["head_dim"] = shape.head_dim
    if shape.is_moe:
        options.update(
            num_experts=shape.experts,
            num_experts_per_tok=shape.topk,
            moe_intermediate_size=shape.moe_ffn,
        )
        return transformers.Qwen3MoeConfig(**options), transformers.Qwen3MoeForCausalLM
    if shape.qk_norm:
        return transformers.Qwen3Config(**options), transformers.Qwen3ForCausalLM
    if shape.qkv_bias:
        return transformers.Qwen2Config(**options), transformers.Qwen2ForCausalLM
    return transformers.LlamaConfig(**options), transformers.LlamaForCausalLM


@pytest.mark.parametrize(
    "name",
    [
        "qwen2.5-0.5b",
        "qwen2.5-7b",
        "qwen2.5-32b",
        "llama-3-8b",
        "qwen3-0.6b",
        "qwen3-8b",
        "qwen3-30b-a3b",
    ],
)
def test_known_shapes_count_what_transformers_builds(name):
    shape = KNOWN_SHAPES[name]
    config, model_cls = _hf_config(shape)
    with torch.device("meta"):
        model = model_cls(config)
    hf_count = sum(p.numel() for p in model.parameters())  # tied weights counted once
    assert max_stage_params(shape, tp=1, pp=1) == hf_count


def test_moe_experts_split_by_ep_and_their_adam_state_by_expert_dp():
    shape = KNOWN_SHAPES["qwen3-30b-a3b"]
    experts = 48 * 128 * 3 * 768 * 2048  # layers x experts x (gate, up, down) x width x hidden
    one = TrainedModel(shape, tp=1, dp=16, ep=1)
    eight = dataclasses.replace(one, ep=8)
    assert one.expert_params == experts and eight.expert_params == experts // 8
    assert one.params - eight.params == experts - experts // 8
    assert eight.expert_dp == 2
    sharded = dataclasses.replace(eight, distributed_optimizer=True)
    dense = eight.params - eight.expert_params
    # bf16: fp32 master + 2 Adam moments = 3 fp32 values, dense over DP, experts over expert DP
    assert optimizer_bytes(sharded) == 4 * 3 * (-(-dense // 16) + -(-experts // 8 // 2))


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
    from rlcli.validation.loader import load_config

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
    from rlcli.validation.loader import load_config

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


def test_qwen3_moe_recipe_fits_its_stated_cluster_and_names_ep_as_the_fix(capsys):
    moe = ["plan", "recipes/grpo_qwen3_30b_a3b.yaml", "--nodes", "2", "--gpus-per-node", "8"]
    code, out, _ = run_cli(capsys, *moe, "--gpu-memory-gb", "80")
    assert code == 0 and "-> fits" in out, out
    assert "experts: 128 per MoE layer, top-8, ep=8 expert_tp=1 (expert dp=2)" in out
    code, out, _ = run_cli(capsys, *moe, "parallel.ep=1", "--gpu-memory-gb", "80")
    assert code == 1 and "smallest change that fits: parallel.ep=" in out, out


def test_qwen3_dense_recipe_fits(capsys):
    code, out, _ = run_cli(capsys, "plan", "recipes/grpo_qwen3_8b.yaml", "--gpus-per-node", "8")
    assert code == 0 and "known shape for 'Qwen3-8B'" in out and "-> fits" in out, out


def test_quickstart_plans_from_its_built_spec(capsys, tmp_path):
    # A fresh output folder: after `make demo` the built model's config.json would answer first.
    output = f"trainer.output_dir={tmp_path}"
    code, out, _ = run_cli(
        capsys, "plan", "recipes/quickstart.yaml", output, "--gpus-per-node", "1"
    )
    assert code == 0 and "model.spec (built locally)" in out


def test_a_built_qwen3_5_spec_is_planned_with_the_builders_layers(tmp_path):
    """The spec's shape is the one of the config.json the builder writes (vocabulary apart:
    the tokenizer trained on the task decides it)."""
    from transformers import Qwen3_5TextConfig

    from parallel.model_shapes import ModelShape
    from rlcli.commands.plan_inputs import model_shape
    from rlcli.model.builder import hybrid_layers
    from rlcli.validation.loader import load_config

    cfg = load_config(
        "recipes/quickstart.yaml",
        [f"trainer.output_dir={tmp_path}", "model.spec.architecture=qwen3_5"],
    )
    shape, where = model_shape(cfg, None)
    spec = cfg.model.spec
    written = Qwen3_5TextConfig(
        hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size, vocab_size=spec.vocab_size,
        tie_word_embeddings=spec.tie_word_embeddings, **hybrid_layers(spec),
    )  # fmt: skip
    assert where == "model.spec (built locally)"
    assert shape == ModelShape.from_hf_config(written.to_dict())
    assert shape.linear is not None and shape.linear.layers == (1, 1, 1, 0)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["model.path=/models/NoSuchModel"], "--model-config"),
        (["parallel.tp=8"], "key/value heads"),
        (["parallel.tp=3"], "not divisible"),
        (["actor.recompute=sometimes"], "actor.recompute"),
        (["--nodes", "0"], "--nodes"),
        (["--model-config", "/nonexistent/config.json"], "--model-config"),
        (["model.moe_aux_loss_coef=0.01"], "model.moe_aux_loss_coef: the"),
        (["parallel.ep=2"], "has no experts"),
        (["model.moe_token_dispatcher=broadcast"], "model.moe_token_dispatcher"),
    ],
)
def test_bad_input_is_a_user_error(capsys, extra, needle):
    code, _, err = run_cli(capsys, *SEVEN_B, *extra)
    assert code == 2 and needle in err, err


def test_separate_placement_plans_trainer_and_rollout_gpus_apart(capsys):
    """12 trainer GPUs (dp 3 at tp 4) without an engine; 4 rollout GPUs with only theirs."""
    separate = ["rollout.placement=separate", "rollout.num_ranks=4", "rollout.tp=2"]
    colocated_code, colocated, _ = run_cli(capsys, *SEVEN_B)
    code, out, _ = run_cli(capsys, *SEVEN_B, *separate, "rollout.gpu_memory_utilization=0.85")
    assert code == 0 and colocated_code == 0, out
    assert "tp=4 pp=1 dp=3" in out and "12 trainer GPUs" in out and "2 engines" in out
    rollout_line = re.search(r"^rollout GPU\s+([\d.]+)", out, flags=re.MULTILINE)
    table = out.split("per GPU, GiB")[1][: out.split("per GPU, GiB")[1].index("rollout GPU ")]
    assert "vLLM" not in table  # no engine on a trainer GPU
    assert "total, everything offloaded" not in out  # the actor offloads nothing for an engine
    rollout_gpu = float(rollout_line.group(1))
    assert rollout_gpu == pytest.approx(0.85 * 80 + 1 + 2, abs=0.01)  # engine, buckets, reserve
    assert "-> fits" in out and "rollout GPUs at" in out
    # The rollout GPUs' engine alone can be too large: then nothing fits.
    code, out, _ = run_cli(capsys, *SEVEN_B, *separate, "rollout.gpu_memory_utilization=0.99")
    assert code == 1 and "does NOT fit" in out
    assert "rollout.gpu_memory_utilization=" in out  # the fix names the engine's share


@pytest.mark.parametrize(
    "nodes, extra, needle",
    [
        (
            "3",
            ["parallel.ep=3"],
            "parallel.ep=3 must divide the 'Qwen3-30B-A3B' model's 128 experts",
        ),
        ("2", ["parallel.ep=32"], "parallel.ep must divide the data-parallel size 16"),
        ("2", ["parallel.tp=2"], "parallel.sequence_parallel=true"),
    ],
)
def test_bad_expert_layout_is_a_user_error(capsys, nodes, extra, needle):
    moe = ["plan", "recipes/grpo_qwen3_30b_a3b.yaml", "--nodes", nodes, "--gpus-per-node", "8"]
    code, _, err = run_cli(capsys, *moe, *extra)
    assert code == 2 and needle in err, err


def test_hybrid_known_shapes_are_the_checkpoints_configs():
    # transformers documents its Qwen3-Next and Qwen3.5-MoE config defaults as these checkpoints'
    from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig

    from parallel.model_shapes import KNOWN_SHAPES, ModelShape

    for name, config in (
        ("qwen3-next-80b-a3b", Qwen3NextConfig()),
        ("qwen3.5-35b-a3b", Qwen3_5MoeTextConfig()),
    ):
        assert ModelShape.from_hf_config(config.to_dict()) == KNOWN_SHAPES[name], name


def test_delta_net_activations_by_hand():
    from parallel.memory_terms import DELTA_NET_CHUNK, delta_net_bytes_per_token
    from parallel.model_shapes import LinearAttentionShape

    linear = LinearAttentionShape((1,), key_heads=2, value_heads=4, key_dim=8, value_dim=4,
                                  conv_kernel=4)  # fmt: skip
    # K = 16, V = 16: in_proj 2K + 2V + 2 x 4 heads = 72, conv 2 (2K + V) = 96, normed q and k
    # at the value heads 2 x 4 x 8 = 64, output and gated norm 3V = 48; state 4 x 8 x 4 x 4 bytes
    assert delta_net_bytes_per_token(linear, 2) == 2 * (72 + 96 + 64 + 48) + 512 / DELTA_NET_CHUNK


def test_qwen3_5_moe_recipe_fits_its_stated_cluster(capsys):
    recipe = ["plan", "recipes/grpo_qwen3_5_35b_a3b.yaml", "--nodes", "2", "--gpus-per-node", "8"]
    code, out, _ = run_cli(capsys, *recipe, "--gpu-memory-gb", "80")
    assert code == 0 and "-> fits" in out, out
    assert "known shape for 'Qwen3.5-35B-A3B-text'" in out  # the extracted language model
    assert "experts: 256 per MoE layer, top-8, ep=8 expert_tp=1 (expert dp=2)" in out
