"""Check 9 of the GPU check: MoE routing on the GPU's bf16 kernels, and what replay fixes.

The HF engine (bf16, CUDA) samples from a small random Qwen3-MoE and returns the experts it routed
every token to; the bf16 Megatron actor then scores the same tokens freely and replaying the
engine's experts (R3). On CPU the two agree exactly in fp32; on a GPU their bf16 kernels differ, so
this measures how many token-layers route differently there and how much of the log-prob gap
replay closes. It also checks R2's own loop on the GPU: replaying the trainer's recorded experts
gives back its free log-probs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.gpu.common import BF16, Context

MOE_GPU = dict(
    hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, intermediate_size=1024, moe_intermediate_size=256, num_experts=16,
    num_experts_per_tok=4, vocab_size=4099, max_position_embeddings=1024,
)  # fmt: skip
MOE_CPU = dict(
    hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
    head_dim=64, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
    num_experts_per_tok=2, vocab_size=251, max_position_embeddings=256,
)  # fmt: skip


def make_moe_model(out_dir: Path, shape: dict, seed: int) -> Path:
    """A random fp32 Qwen3-MoE (softmax top-k, renormalised) with a generation_config naming
    EOS 0."""
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if (out_dir / "config.json").exists():
        return out_dir
    config = Qwen3MoeConfig(**shape, norm_topk_prob=True, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(eos_token_id=0).save_pretrained(out_dir)
    return out_dir


def check_moe_routing_replay(ctx: Context) -> tuple[bool, str]:
    from parallel.forward_passes import forward_log_probs, forward_log_probs_and_routing
    from parallel.hf_model import load_hf_model
    from parallel.model_options import ModelBuildOptions, MoeOptions
    from rlcli.rollout.batch import collate
    from tests.rlcli.engine_routing_worker import compare, sampled

    model_dir = make_moe_model(ctx.work / "moe", MOE_CPU if ctx.cpu else MOE_GPU, seed=0)
    options = ModelBuildOptions(moe=MoeOptions(routing_replay=True))
    models = load_hf_model(model_dir, ctx.mesh, dtype=BF16, options=options)
    samples = sampled(str(model_dir), "bfloat16", prompts=8 if ctx.cpu else 32, max_tokens=16)
    r3 = compare(models, ctx.mesh, samples)
    # R2's loop: the trainer's own recorded experts, replayed, give its free log-probs back
    batch = collate(samples, pad_id=0)
    ids, mask = batch.input_ids, batch.attention_mask
    free = forward_log_probs(models, ctx.mesh, ids, mask, 8)
    _, notes = forward_log_probs_and_routing(models, ctx.mesh, ids, mask, 8)
    own, _ = forward_log_probs_and_routing(models, ctx.mesh, ids, mask, 8, replay=notes.recorded)
    real = mask[:, 1:].bool().to(free.device)
    r2_gap = float((own - free).abs()[real].max())
    del models
    ok = (
        r3["read_positions"] == r3["expected_read_positions"]
        and r3["replay_diff_mean"] <= r3["free_diff_mean"] + 1e-6
        and r2_gap < 1e-2
    )
    detail = (
        f"bf16 engine vs bf16 trainer: {100 * r3['routing_mismatch']:.2f}% of token-layers routed "
        f"differently ({r3['read_positions']} tokens); |log-prob diff| of sampled tokens "
        f"mean {r3['free_diff_mean']:.2e} -> {r3['replay_diff_mean']:.2e} with R3, max "
        f"{r3['free_diff_max']:.2e} -> {r3['replay_diff_max']:.2e}; R2 replay of the trainer's "
        f"own experts vs free: max {r2_gap:.1e}"
    )
    return ok, detail
