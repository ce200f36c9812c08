"""The benchmark's result JSON as a Markdown table and a matplotlib chart (benchmarks/chart.py).

Public API:

    write_report(results, output_dir, stem, update_latest=True) -> {"json", "md", "png", ...}
    markdown_table(results) -> str
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from benchmarks.chart import draw_chart
from benchmarks.formatting import (
    PHASE_LABELS,
    flops,
    gb,
    memory_rows,
    num,
    params,
    pct,
    threads_note,
)
from benchmarks.mismatch import mismatch_table
from benchmarks.placement import placement_table
from benchmarks.recovery import recovery_table


def write_report(
    results: dict, output_dir: Path, stem: str, update_latest: bool = True
) -> dict[str, Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "json": output_dir / f"{stem}.json",
        "md": output_dir / f"{stem}.md",
        "png": output_dir / f"{stem}.png",
    }
    files["json"].write_text(json.dumps(results, indent=2) + "\n")
    files["md"].write_text(markdown_table(results))
    draw_chart(results, files["png"])
    if update_latest:
        for kind in ("md", "png"):
            files[f"latest_{kind}"] = output_dir / f"latest.{kind}"
            shutil.copyfile(files[kind], files[f"latest_{kind}"])
    return files


# ---------------------------------------------------------------------------------------------
# Markdown


def markdown_table(results: dict) -> str:
    device = results.get("device", {})
    hardware = device.get("hardware", {})
    load = results.get("load_average", {})
    lines = [
        f"### rlcli benchmark: {results['host']}, {results['date']} ({results['mode']} mode)",
        "",
        f"{hardware.get('device_name', 'unknown device')} x{hardware.get('num_devices', 1)}, "
        f"{hardware.get('cpu_cores', '?')} CPU cores ({threads_note(results)}), "
        f"torch {hardware.get('torch_version', '?')}; "
        f"load average {load.get('start', ['?'])[0]} at start, {load.get('end', ['?'])[0]} at "
        f"end; whole run {results.get('wall_seconds', 0):.0f} s.",
    ]
    rows = _rollout_rows(results.get("rollout"))
    rows += _sync_rows(results.get("sync"))
    rows += _train_rows(results.get("train"), device)
    rows += _lora_rows(results.get("lora"), results.get("train"))
    if rows:  # a run of other sections only has no main table
        lines += [
            "",
            "| what | rlcli | simplest alternative | floor / ceiling | rlcli vs alternative |",
            "| --- | --- | --- | --- | --- |",
            *rows,
        ]
    lines += _grpo_table(results.get("grpo"))
    lines += placement_table(results.get("placement"))
    lines += mismatch_table(results.get("mismatch"))
    lines += recovery_table(results.get("recovery"))
    lines += _memory_table(results)
    errors = results.get("errors", {})
    if errors:
        lines += ["", "Sections that failed: " + ", ".join(sorted(errors)) + " (see the JSON)."]
    return "\n".join(lines) + "\n"


def _rollout_rows(rollout: dict | None) -> list[str]:
    if not rollout:
        return []
    what = (
        f"rollout new tokens/s ({rollout['model']}, {params(rollout['params'])} params, "
        f"{rollout['prompts']} prompts x {rollout['n']} samples x <= {rollout['max_tokens']} "
        f"tokens, {rollout['dtype']})"
    )
    ceiling = rollout.get("compute_ceiling_tokens_per_s")
    return [
        f"| {what} | vLLM {num(rollout['vllm']['tokens_per_s'])} | HF generate "
        f"{num(rollout['hf']['tokens_per_s'])} | compute ceiling {num(ceiling)} | "
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
            f"weight sync {size['model']} ({params(size['params'])} params, "
            f"{gb(size['bytes'])}, {size['num_buckets']} bucket(s), {buckets})"
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
        f"actor update tokens/s ({train['model']}, {params(train['params'])} params, "
        f"{train['tokens_per_step']} tokens/step, {train['dtype']}, attention "
        f"{train.get('attention', 'local')})"
    )
    floor = f"measured matmul {flops(matmul)}"
    if peak:
        floor += f", data-sheet peak {flops(peak)}"
    return (
        [
            f"| {what} | Megatron {num(megatron['tokens_per_s'])} "
            f"({flops(megatron['flops_per_s'])}, MFU {pct(megatron.get('mfu'))}, "
            f"{pct(megatron.get('matmul_fraction'))} of matmul) | HF + torch AdamW "
            f"{num(hf['tokens_per_s'])} ({pct(hf.get('matmul_fraction'))} of matmul) | "
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
        return f"{name} {num(run['tokens_per_s'])} (peak {run['memory']['peak_gb']:.2f} GiB)"

    others = [name for name in backends if name != "local"]
    best = max(others, key=lambda name: backends[name]["tokens_per_s"])
    return [
        f"| core attention, same batch (model.attention_backend) | "
        f"{'; '.join(cell(name) for name in others)} | megatron's unfused {cell('local')} | "
        f"HF + AdamW {num(train['hf_baseline']['tokens_per_s'])} | "
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
            f"{name} {num(run['tokens_per_s'])}, {pct(run['padded_fraction'])} padded "
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
        f"{pct(mixed['batch_wide_padded_fraction'])}) | 0% padded | {ratio} |"
    ]


def _lora_rows(lora: dict | None, train: dict | None) -> list[str]:
    """LoRA against full fine-tuning (the train section's Megatron row: same model and batch),
    and the LoRA sync merged against adapter."""
    if not lora:
        return []
    update, rows = lora["update"], []
    what = (
        f"actor update with LoRA ({lora['model']}, rank {lora['rank']} on every linear: "
        f"{params(lora['trainable_params'])} trainable of {params(lora['params'])}, "
        f"{lora['tokens_per_step']} tokens/step, {lora['dtype']}): tokens/s, peak memory"
    )
    if train:
        full = train["megatron"]
        rows.append(
            f"| {what} | LoRA {num(update['tokens_per_s'])}, peak "
            f"{update['memory']['peak_gb']:.2f} GiB | full fine-tuning "
            f"{num(full['tokens_per_s'])}, peak {full['memory']['peak_gb']:.2f} GiB | | "
            f"{update['tokens_per_s'] / full['tokens_per_s']:.2f}x |"
        )
    sync = lora.get("sync")
    if sync:
        adapter, merged = sync["adapter"], sync["merged"]
        rows.append(
            f"| LoRA weight sync into vLLM ({lora['model']}, rank {lora['rank']}) | adapter "
            f"{adapter['seconds']:.3g} s ({gb(adapter['bytes'])}) | merged {merged['seconds']:.3g} s "
            f"({gb(merged['bytes'])}) | | {sync['adapter_over_merged']:.2f}x faster |"
        )
    return rows


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
        lines.append(f"| {label} | {value['seconds']:.3f} | {pct(value['share'])} |")
    return lines


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
