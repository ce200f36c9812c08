"""The benchmark's result JSON as a Markdown table (the chart is benchmarks/chart.py, the files
of a run benchmarks/run.py's write_report).

Public API:

    markdown_table(results) -> str
    memory_rows(results); fmt_num, fmt_flops, fmt_pct, fmt_threads (shared with the chart)
"""

from __future__ import annotations

PHASE_LABELS = {
    "offload": "actor offload",
    "gen": "generation",
    "reward": "reward",
    "distribute": "distribute (DP share + collate)",
    "onload": "actor onload",
    "old_log_prob": "old log-probs",
    "ref": "reference log-probs",
    "adv": "advantages",
    "update": "actor update",
    "sync": "weight sync",
    "other": "other",
}


# ---------------------------------------------------------------------------------------------
# Markdown


def fmt_num(value: float | None, digits: int = 3) -> str:
    """A figure with `digits` significant digits and thousands separators; n/a for None."""
    if value is None:
        return "n/a"
    if abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def fmt_flops(value: float | None) -> str:
    if value is None:
        return "n/a"
    return (
        f"{fmt_num(value / 1e12)} TFLOP/s" if value >= 1e12 else f"{fmt_num(value / 1e9)} GFLOP/s"
    )


def fmt_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _gb(value_bytes: float) -> str:
    return f"{value_bytes / 1e9:.3g} GB" if value_bytes >= 1e8 else f"{value_bytes / 1e6:.3g} MB"


def _params(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def markdown_table(results: dict) -> str:
    device = results.get("device", {})
    hardware = device.get("hardware", {})
    load = results.get("load_average", {})
    lines = [
        f"### rlcli benchmark: {results['host']}, {results['date']} ({results['mode']} mode)",
        "",
        f"{hardware.get('device_name', 'unknown device')} x{hardware.get('num_devices', 1)}, "
        f"{hardware.get('cpu_cores', '?')} CPU cores ({fmt_threads(results)}), "
        f"torch {hardware.get('torch_version', '?')}; "
        f"load average {load.get('start', ['?'])[0]} at start, {load.get('end', ['?'])[0]} at "
        f"end; whole run {results.get('wall_seconds', 0):.0f} s.",
        "",
        "| what | rlcli | simplest alternative | floor / ceiling | rlcli vs alternative |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += _rollout_rows(results.get("rollout"))
    lines += _sync_rows(results.get("sync"))
    lines += _train_rows(results.get("train"), device)
    lines += _grpo_table(results.get("grpo"))
    lines += _memory_table(results)
    errors = results.get("errors", {})
    if errors:
        lines += ["", "Sections that failed: " + ", ".join(sorted(errors)) + " (see the JSON)."]
    return "\n".join(lines) + "\n"


def fmt_threads(results: dict) -> str:
    threads = results.get("cpu_threads")
    return "torch threads: default" if threads is None else f"torch threads: {threads}"


def _rollout_rows(rollout: dict | None) -> list[str]:
    if not rollout:
        return []
    what = (
        f"rollout new tokens/s ({rollout['model']}, {_params(rollout['params'])} params, "
        f"{rollout['prompts']} prompts x {rollout['n']} samples x <= {rollout['max_tokens']} "
        f"tokens, {rollout['dtype']})"
    )
    ceiling = rollout.get("compute_ceiling_tokens_per_s")
    return [
        f"| {what} | vLLM {fmt_num(rollout['vllm']['tokens_per_s'])} | HF generate "
        f"{fmt_num(rollout['hf']['tokens_per_s'])} | compute ceiling {fmt_num(ceiling)} | "
        f"{rollout['vllm_over_hf']:.2f}x |"
    ]


def _sync_rows(sync: dict | None) -> list[str]:
    if not sync:
        return []
    rows = []
    for size in sync["sizes"]:
        reshard, naive, floor = size["reshard"], size["naive"], size["memcpy"]
        buckets = f"{sync['bucket_mb']} MB" if sync["bucket_mb"] else "automatic size"
        what = (
            f"weight sync {size['model']} ({_params(size['params'])} params, "
            f"{_gb(size['bytes'])}, {size['num_buckets']} bucket(s), {buckets})"
        )
        reload = size.get("engine_reload")
        own = ""
        if reload:
            own = (
                f"; vLLM's own reload_weights {reload['seconds']:.3g} s "
                f"(sync = {reshard['seconds'] / reload['seconds']:.2f}x of it)"
            )
        rows.append(
            f"| {what} | {reshard['seconds']:.3g} s ({reshard['gbps']:.3g} GB/s) | naive "
            f"per-tensor {naive['seconds']:.3g} s ({naive['gbps']:.3g} GB/s) | memcpy "
            f"{floor['seconds']:.3g} s ({floor['gbps']:.3g} GB/s){own} | "
            f"{naive['seconds'] / reshard['seconds']:.2f}x faster |"
        )
    return rows


def _train_rows(train: dict | None, device: dict) -> list[str]:
    if not train:
        return []
    megatron, hf = train["megatron"], train["hf_baseline"]
    matmul = device.get("matmul_flops")
    peak = device.get("hardware", {}).get("peak_bf16_flops")
    what = (
        f"actor update tokens/s ({train['model']}, {_params(train['params'])} params, "
        f"{train['tokens_per_step']} tokens/step, {train['dtype']}, attention "
        f"{train.get('attention', 'local')})"
    )
    floor = f"measured matmul {fmt_flops(matmul)}"
    if peak:
        floor += f", data-sheet peak {fmt_flops(peak)}"
    return (
        [
            f"| {what} | Megatron {fmt_num(megatron['tokens_per_s'])} "
            f"({fmt_flops(megatron['flops_per_s'])}, MFU {fmt_pct(megatron.get('mfu'))}, "
            f"{fmt_pct(megatron.get('matmul_fraction'))} of matmul) | HF + torch AdamW "
            f"{fmt_num(hf['tokens_per_s'])} ({fmt_pct(hf.get('matmul_fraction'))} of matmul) | "
            f"{floor} | {train['megatron_over_hf']:.2f}x |"
        ]
        + _attention_rows(train)
        + _mixed_rows(train.get("mixed_lengths"), train)
    )


def _attention_rows(train: dict) -> list[str]:
    """The core attentions on the same batch: rlcli's default against megatron's unfused one."""
    backends = train.get("attention_backends") or {}
    if "local" not in backends or len(backends) < 2:
        return []

    def cell(name: str) -> str:
        run = backends[name]
        return f"{name} {fmt_num(run['tokens_per_s'])} (peak {run['memory']['peak_gb']:.2f} GiB)"

    others = [name for name in backends if name != "local"]
    best = max(others, key=lambda name: backends[name]["tokens_per_s"])
    return [
        f"| core attention, same batch (model.attention_backend) | "
        f"{'; '.join(cell(name) for name in others)} | megatron's unfused {cell('local')} | "
        f"HF + AdamW {fmt_num(train['hf_baseline']['tokens_per_s'])} | "
        f"{best} {backends[best]['tokens_per_s'] / backends['local']['tokens_per_s']:.2f}x |"
    ]


def _mixed_rows(mixed: dict | None, train: dict) -> list[str]:
    if not mixed:
        return []
    fixed, budget = mixed["fixed"], mixed["token_budget"]
    packed = mixed.get("packed")
    what = (
        f"actor update on mixed lengths ({train['model']}, {mixed['rows']} rows of "
        f"{mixed['seq_len'] // 8}-{mixed['seq_len']} tokens): real tokens/s, padded share"
    )

    def cell(name: str, run: dict) -> str:
        return (
            f"{name} {fmt_num(run['tokens_per_s'])}, {fmt_pct(run['padded_fraction'])} padded "
            f"({run['micro_batches']} micro-batches)"
        )

    ours = cell("token budget", budget)
    ratio = f"{mixed['budget_over_fixed']:.2f}x"
    if packed:
        ours = f"{cell('packed', packed)}; {ours}"
        ratio = (
            f"packed {packed['tokens_per_s'] / fixed['tokens_per_s']:.2f}x, budget {ratio} "
            f"(packed / budget {mixed['packed_over_budget']:.2f}x)"
        )
    return [
        f"| {what} | {ours} | {cell('fixed micro-batches', fixed)} (batch-wide S: "
        f"{fmt_pct(mixed['batch_wide_padded_fraction'])}) | 0% padded | {ratio} |"
    ]


def _grpo_table(grpo: dict | None) -> list[str]:
    if not grpo:
        return []
    lines = [
        "",
        f"GRPO step of the trainer ({grpo['recipe']}, {' '.join(grpo['overrides'])}): "
        f"{grpo['step_seconds']:.2f} s per step, mean of {grpo['measured_steps']} steps after "
        "the first.",
        "",
    ]
    plain = grpo.get("plain_loop")
    if plain:
        ratio = plain["median_step_seconds"] / grpo["median_step_seconds"]
        lines += [
            f"Median step: rlcli {grpo['median_step_seconds']:.3f} s; the plain single-process "
            f"PyTorch GRPO loop (benchmarks/plain_loop.py: HF generate + one log-prob forward/"
            f"backward + AdamW, same model, batch and task) {plain['median_step_seconds']:.3f} s: "
            f"rlcli {ratio:.2f}x as fast.",
            "",
        ]
    lines += [
        "| phase | seconds | share of step |",
        "| --- | --- | --- |",
    ]
    for phase, value in grpo["phases"].items():
        label = PHASE_LABELS.get(phase, phase)
        lines.append(f"| {label} | {value['seconds']:.3f} | {fmt_pct(value['share'])} |")
    return lines


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
    if results.get("grpo"):
        rows.append(("GRPO run (whole)", results["grpo"]["memory"]))
    return rows


def _memory_table(results: dict) -> list[str]:
    rows = memory_rows(results)
    if not rows:
        return []
    lines = [
        "",
        "Peak memory per phase (a full run gives each section its own process):",
        "",
        "| phase | peak GiB | GiB at phase start | measured as |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {name} | {m['peak_gb']:.2f} | {m['start_gb']:.2f} | {m['source']} |" for name, m in rows
    ]
    return lines
