"""Run as a plain process (one rank). Used by test_routing_replay_r3.py.

    engine_routing_worker.py MODEL_DIR OUT_JSON

R3's pieces against each other: the HF engine samples from a tiny Qwen3-MoE and returns the
experts it routed every token to (``SamplingConfig.routing``), read by hooks on transformers'
routers; the trainer (megatron-core, fp32) then
1. records its own routing of the same tokens (R2's recording pass): with the engine in fp32 the
   two must agree token by token, layer by layer, which checks the engine's capture and the
   collated layout against an independent implementation;
2. computes the sampled tokens' log-probs freely and replaying the engine's experts, against the
   engine's own log-probs, with engines that route differently from the trainer: one in bf16
   (routers that flip on rounding, as GPU kernels make them flip; how many depends on the CPU's
   bf16 kernels) and one in fp32 whose routers were moved a little (``moved``: flips on every
   machine), the numbers with and without replay.
"""

from __future__ import annotations

import json
import sys

import torch

from parallel.forward_passes import forward_log_probs, forward_log_probs_and_routing
from parallel.hf_model import load_hf_model
from parallel.mesh import init_parallel
from parallel.model_options import ModelBuildOptions, MoeOptions
from rlcli.process_lifetime import exit_skipping_teardown
from rlcli.rollout.base import SamplingConfig
from rlcli.rollout.batch import Sample, collate, response_values
from rlcli.rollout.hf_engine import HFEngine

PROMPTS, N = 6, 2


def sampled(
    model_dir: str, dtype: str, prompts: int = PROMPTS, max_tokens: int = 10
) -> list[Sample]:
    """``N`` samples for each of ``prompts`` random prompts, with the engine's routing."""
    engine = HFEngine(model_dir, dtype=dtype, seed=3)
    vocab = engine.model.config.vocab_size
    generator = torch.Generator().manual_seed(4)
    prompt_ids = [
        torch.randint(3, vocab, (int(length),), generator=generator).tolist()
        for length in torch.randint(4, 12, (prompts,), generator=generator)
    ]
    sampling = SamplingConfig(temperature=1.0, max_tokens=max_tokens, seed=5, routing=True)
    outputs = engine.generate(prompt_ids, N, sampling)
    engine.close()
    return [
        Sample(
            group=g,
            prompt_ids=prompt,
            response_ids=c.token_ids,
            engine_log_probs=c.logprobs,
            finish_reason=c.finish_reason,
            item=None,
            routing=c.routing,
        )
        for g, (prompt, completions) in enumerate(zip(prompt_ids, outputs, strict=True))
        for c in completions
    ]


def compare(models, mesh, samples: list[Sample]) -> dict:
    """The engine's routing and log-probs against the trainer's (module docstring)."""
    batch = collate(samples, pad_id=0)
    ids, mask = batch.input_ids, batch.attention_mask
    _, own = forward_log_probs_and_routing(models, mesh, ids, mask, 4)
    known = mask.bool() & (batch.routing >= 0).all(-1).all(-1)
    engine_sets, own_sets = batch.routing.sort(-1).values, own.recorded.sort(-1).values
    differs = (engine_sets != own_sets).any(-1)[known]  # [token-layers]
    free = forward_log_probs(models, mesh, ids, mask, 4)
    replayed, notes = forward_log_probs_and_routing(
        models, mesh, ids, mask, 4, replay=batch.routing
    )
    generated = batch.response_mask.bool()

    def diff(per_position: torch.Tensor) -> torch.Tensor:
        trainer = response_values(per_position.cpu(), batch.response_index)
        return (trainer - batch.engine_log_probs).abs()[generated]

    return {
        "routing_shape": list(batch.routing.shape),
        "read_positions": int(known.sum()),
        "expected_read_positions": sum(s.num_tokens - 1 for s in samples),
        "routing_mismatch": float(differs.float().mean()),
        "replay_reports_mismatch": notes.changed_share,
        "free_diff_mean": float(diff(free).mean()),
        "free_diff_max": float(diff(free).max()),
        "replay_diff_mean": float(diff(replayed).mean()),
        "replay_diff_max": float(diff(replayed).max()),
    }


def with_moved_routers(model_dir: str, out_dir: str) -> str:
    """A copy of the model whose routers moved by noise of 0.3x their own spread."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                noise = torch.randn(param.shape, generator=generator)
                param += 0.3 * float(param.std()) * noise
    model.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    mesh = init_parallel(tp=1, pp=1, seed=1)
    options = ModelBuildOptions(moe=MoeOptions(routing_replay=True))
    models = load_hf_model(model_dir, mesh, options=options)
    moved = with_moved_routers(model_dir, out + ".moved")
    engines = {"float32": (model_dir, "float32"), "bfloat16": (model_dir, "bfloat16")}
    engines["moved"] = (moved, "float32")
    result = {
        name: compare(models, mesh, sampled(path, dtype)) for name, (path, dtype) in engines.items()
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
