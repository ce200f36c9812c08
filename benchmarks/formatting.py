"""Figures as the benchmark report writes them (Markdown table and chart alike)."""

from __future__ import annotations

PHASE_LABELS = {
    "offload": "offload (residency plan)",
    "gen": "generation",
    "reward": "reward",
    "distribute": "distribute (DP share + collate)",
    "onload": "onload (residency plan)",
    "old_log_prob": "old log-probs",
    "ref": "reference log-probs",
    "adv": "advantages",
    "update": "actor update",
    "sync": "weight sync",
    "other": "other",
}


def num(value: float | None, digits: int = 3) -> str:
    """A figure with `digits` significant digits and thousands separators; n/a for None."""
    if value is None:
        return "n/a"
    if abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def flops(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{num(value / 1e12)} TFLOP/s" if value >= 1e12 else f"{num(value / 1e9)} GFLOP/s"


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def gb(value_bytes: float) -> str:
    return f"{value_bytes / 1e9:.3g} GB" if value_bytes >= 1e8 else f"{value_bytes / 1e6:.3g} MB"


def params(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def threads_note(results: dict) -> str:
    threads = results.get("cpu_threads")
    return "torch threads: default" if threads is None else f"torch threads: {threads}"


def memory_rows(results: dict) -> list[tuple[str, dict]]:
    """(phase label, memory dict) for every phase that measured its peak."""
    rows = []
    rollout = results.get("rollout")
    if rollout:
        rows += [("rollout: HF generate", rollout["hf"]["memory"])]
        rows += [("rollout: vLLM", rollout["vllm"]["memory"])]
    for size in (results.get("sync") or {}).get("sizes", []):
        rows.append((f"sync: {size['model']}", size["memory"]))
    train = results.get("train")
    if train:
        rows += [("train: Megatron actor", train["megatron"]["memory"])]
        rows += [("train: HF + AdamW", train["hf_baseline"]["memory"])]
    lora = results.get("lora")
    if lora:
        rows += [(f"train: Megatron actor, LoRA rank {lora['rank']}", lora["update"]["memory"])]
    if results.get("grpo"):
        rows.append(("GRPO run (whole)", results["grpo"]["memory"]))
    return rows


def single_process_sizes(sync: dict) -> list[dict]:
    """The rows of the size sweep (not the 2-process layout variants)."""
    return [size for size in sync["sizes"] if size.get("processes", 1) == 1]
