"""The benchmark's result JSON as a Markdown table and a matplotlib chart (Agg backend).

Public API:

    write_report(results, output_dir, stem, update_latest=True) -> {"json", "md", "png", ...}
    markdown_table(results) -> str
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from benchmarks.placement import placement_table

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


def _num(value: float | None, digits: int = 3) -> str:
    """A figure with `digits` significant digits and thousands separators; n/a for None."""
    if value is None:
        return "n/a"
    if abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def _flops(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{_num(value / 1e12)} TFLOP/s" if value >= 1e12 else f"{_num(value / 1e9)} GFLOP/s"


def _pct(value: float | None) -> str:
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
        f"{hardware.get('cpu_cores', '?')} CPU cores ({_threads(results)}), "
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
    lines += placement_table(results.get("placement"))
    lines += _memory_table(results)
    errors = results.get("errors", {})
    if errors:
        lines += ["", "Sections that failed: " + ", ".join(sorted(errors)) + " (see the JSON)."]
    return "\n".join(lines) + "\n"


def _threads(results: dict) -> str:
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
        f"| {what} | vLLM {_num(rollout['vllm']['tokens_per_s'])} | HF generate "
        f"{_num(rollout['hf']['tokens_per_s'])} | compute ceiling {_num(ceiling)} | "
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
        f"{train['tokens_per_step']} tokens/step, {train['dtype']})"
    )
    floor = f"measured matmul {_flops(matmul)}"
    if peak:
        floor += f", data-sheet peak {_flops(peak)}"
    return [
        f"| {what} | Megatron {_num(megatron['tokens_per_s'])} "
        f"({_flops(megatron['flops_per_s'])}, MFU {_pct(megatron.get('mfu'))}, "
        f"{_pct(megatron.get('matmul_fraction'))} of matmul) | HF + torch AdamW "
        f"{_num(hf['tokens_per_s'])} ({_pct(hf.get('matmul_fraction'))} of matmul) | "
        f"{floor} | {train['megatron_over_hf']:.2f}x |"
    ] + _mixed_rows(train.get("mixed_lengths"), train)


def _mixed_rows(mixed: dict | None, train: dict) -> list[str]:
    if not mixed:
        return []
    fixed, budget = mixed["fixed"], mixed["token_budget"]
    what = (
        f"actor update on mixed lengths ({train['model']}, {mixed['rows']} rows of "
        f"{mixed['seq_len'] // 8}-{mixed['seq_len']} tokens): real tokens/s, padded share"
    )
    return [
        f"| {what} | token budget {_num(budget['tokens_per_s'])}, {_pct(budget['padded_fraction'])}"
        f" padded ({budget['micro_batches']} micro-batches) | fixed micro-batches "
        f"{_num(fixed['tokens_per_s'])}, {_pct(fixed['padded_fraction'])} padded (batch-wide S: "
        f"{_pct(mixed['batch_wide_padded_fraction'])}) | 0% padded | "
        f"{mixed['budget_over_fixed']:.2f}x |"
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
        lines.append(f"| {label} | {value['seconds']:.3f} | {_pct(value['share'])} |")
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


# ---------------------------------------------------------------------------------------------
# Chart


def draw_chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 3, figsize=(16, 9))
    figure.suptitle(
        f"rlcli benchmark: {results['host']} {results['date']} ({results['mode']}, "
        f"{results.get('device', {}).get('hardware', {}).get('device_name', '?')})"
    )
    _bars(axes[0][0], results.get("rollout"), "rollout new tokens/s",
          [("HF generate", ("hf", "tokens_per_s")), ("vLLM", ("vllm", "tokens_per_s"))])  # fmt: skip
    _sync_plot(axes[0][1], results.get("sync"))
    _bars(axes[0][2], results.get("train"), "actor update tokens/s",
          [("HF + AdamW", ("hf_baseline", "tokens_per_s")),
           ("Megatron", ("megatron", "tokens_per_s"))])  # fmt: skip
    _phase_plot(axes[1][0], results.get("grpo"))
    _memory_plot(axes[1][1], results)
    _notes(axes[1][2], results)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _missing(ax, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "not run / failed", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def _bars(ax, section: dict | None, title: str, bars: list[tuple[str, tuple[str, str]]]) -> None:
    if not section:
        return _missing(ax, title)
    values = [section[outer][inner] for _, (outer, inner) in bars]
    ax.bar([label for label, _ in bars], values, color=["#999999", "#2a7ab0"])
    for x, value in enumerate(values):
        ax.annotate(_num(value), (x, value), ha="center", va="bottom")
    ax.set_title(f"{title} ({section['model']})")


def _sync_plot(ax, sync: dict | None) -> None:
    title = "weight sync seconds vs model size"
    if not sync:
        return _missing(ax, title)
    sizes = _single_process_sizes(sync)
    params = [size["params"] / 1e6 for size in sizes]
    for key, label, style in (("naive", "naive per-tensor", "o--"), ("reshard", "rlcli reshard",
                              "o-"), ("memcpy", "memcpy floor", "o:")):  # fmt: skip
        ax.plot(params, [size[key]["seconds"] for size in sizes], style, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.minorticks_off()
    ax.set_xticks(params, [f"{count:.3g}M" for count in params])
    ax.set_xlabel("parameters")
    ax.set_ylabel("seconds")
    ax.legend()
    ax.set_title(title)


def _single_process_sizes(sync: dict) -> list[dict]:
    """The rows of the size sweep (not the 2-process layout variants)."""
    return [size for size in sync["sizes"] if size.get("processes", 1) == 1]


def _phase_plot(ax, grpo: dict | None) -> None:
    title = "share of one GRPO step"
    if not grpo:
        return _missing(ax, title)
    phases = list(grpo["phases"].items())
    ax.barh([PHASE_LABELS.get(name, name) for name, _ in phases],
            [100 * value["share"] for _, value in phases], color="#2a7ab0")  # fmt: skip
    ax.invert_yaxis()
    ax.set_xlabel("% of step time")
    ax.set_title(f"{title} ({grpo['step_seconds']:.2f} s)")


def _memory_plot(ax, results: dict) -> None:
    rows = memory_rows(results)
    title = "peak memory per phase (GiB)"
    if not rows:
        return _missing(ax, title)
    ax.barh([name for name, _ in rows], [m["peak_gb"] for _, m in rows], color="#e08a2c")
    ax.invert_yaxis()
    ax.set_title(title)


def _notes(ax, results: dict) -> None:
    """The run's conditions and the ratios against the alternative and the floor."""
    ax.set_axis_off()
    device = results.get("device", {})
    hardware = device.get("hardware", {})
    load = results.get("load_average", {})
    text = [
        f"device: {hardware.get('device_name', '?')} x{hardware.get('num_devices', 1)}",
        f"CPU cores: {hardware.get('cpu_cores', '?')} ({_threads(results)})",
        f"load average start/end: {load.get('start', ['?'])[0]} / {load.get('end', ['?'])[0]}",
        f"whole run: {results.get('wall_seconds', 0):.0f} s",
        f"measured matmul: {_flops(device.get('matmul_flops'))}",
        "",
    ]
    rollout, train, sync = results.get("rollout"), results.get("train"), results.get("sync")
    if rollout:
        text += [
            f"rollout: vLLM / HF = {rollout['vllm_over_hf']:.2f}x",
            f"  compute ceiling {_num(rollout.get('compute_ceiling_tokens_per_s'))} tokens/s",
        ]
    if sync:
        largest = _single_process_sizes(sync)[-1]
        text += [
            f"sync {largest['model']}: naive / reshard = "
            f"{largest['naive']['seconds'] / largest['reshard']['seconds']:.2f}x",
            f"  reshard / memcpy floor = "
            f"{largest['reshard']['seconds'] / largest['memcpy']['seconds']:.1f}x",
        ]
    if train:
        megatron = train["megatron"]
        text += [
            f"train: Megatron / HF+AdamW = {train['megatron_over_hf']:.2f}x",
            f"  {_flops(megatron['flops_per_s'])}, MFU {_pct(megatron.get('mfu'))}, "
            f"{_pct(megatron.get('matmul_fraction'))} of matmul",
        ]
    if results.get("errors"):
        text.append("failed: " + ", ".join(sorted(results["errors"])))
    ax.text(0.0, 1.0, "\n".join(text), va="top", family="monospace", transform=ax.transAxes)
