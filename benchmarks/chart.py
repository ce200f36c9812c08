"""The benchmark's result JSON as a matplotlib chart (Agg backend): draw_chart(results, path)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.formatting import (
    PHASE_LABELS,
    flops,
    memory_rows,
    num,
    pct,
    single_process_sizes,
    threads_note,
)


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
        ax.annotate(num(value), (x, value), ha="center", va="bottom")
    ax.set_title(f"{title} ({section['model']})")


def _sync_plot(ax, sync: dict | None) -> None:
    title = "weight sync seconds vs model size"
    if not sync:
        return _missing(ax, title)
    sizes = single_process_sizes(sync)
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
        f"CPU cores: {hardware.get('cpu_cores', '?')} ({threads_note(results)})",
        f"load average start/end: {load.get('start', ['?'])[0]} / {load.get('end', ['?'])[0]}",
        f"whole run: {results.get('wall_seconds', 0):.0f} s",
        f"measured matmul: {flops(device.get('matmul_flops'))}",
        "",
    ]
    rollout, train, sync = results.get("rollout"), results.get("train"), results.get("sync")
    if rollout:
        text += [
            f"rollout: vLLM / HF = {rollout['vllm_over_hf']:.2f}x",
            f"  compute ceiling {num(rollout.get('compute_ceiling_tokens_per_s'))} tokens/s",
        ]
    if sync:
        largest = single_process_sizes(sync)[-1]
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
            f"  {flops(megatron['flops_per_s'])}, MFU {pct(megatron.get('mfu'))}, "
            f"{pct(megatron.get('matmul_fraction'))} of matmul",
        ]
    if results.get("errors"):
        text.append("failed: " + ", ".join(sorted(results["errors"])))
    ax.text(0.0, 1.0, "\n".join(text), va="top", family="monospace", transform=ax.transAxes)
