"""`python -m benchmarks --smoke`: the benchmark code runs end to end and writes JSON / Markdown /
PNG with the expected keys; its figures are consistent with independent counts. No timing
assertions: the machine is shared and the smoke sizes measure nothing."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from benchmarks.formatting import PHASE_LABELS
from benchmarks.hardware import peak_bf16_flops
from benchmarks.memory import measure_peak_memory
from benchmarks.run import QUICK_SECTIONS, SECTIONS, report_stem, run_benchmark
from benchmarks.workload import QWEN2_05B, QWEN2_15B, SMOKE, ensure_model, workload_for

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="no vLLM")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H20", 148e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("AMD EPYC 7B13", None),
    ],
)
def test_peak_flops_table_matches_the_most_specific_name(name, expected):
    assert peak_bf16_flops(name) == expected


def test_peak_memory_sees_an_allocation_made_inside_the_phase():
    with measure_peak_memory() as memory:
        block = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, touched
        del block
    assert memory.peak_gb - memory.start_gb >= 0.2


def test_gpu_shapes_have_the_published_parameter_counts():
    # Qwen2-0.5B and Qwen2-1.5B model cards / safetensors index: 494,032,768 and 1,543,714,304.
    assert QWEN2_05B.num_params() == 494_032_768
    assert QWEN2_15B.num_params() == 1_543_714_304


def test_model_shape_counts_the_parameters_of_the_built_model(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ensure_model(SMOKE, tmp_path, "float32"))
    assert sum(p.numel() for p in model.parameters()) == SMOKE.num_params()


@needs_vllm
@pytest.mark.vllm
def test_smoke_benchmark_writes_json_markdown_and_chart(tmp_path):
    outputs = run_benchmark(smoke=True, output_dir=tmp_path, log=lambda _: None)
    results = outputs.results
    assert results["errors"] == {}

    stem = f"{results['date']}-{results['host']}-smoke"
    assert outputs.files["json"] == tmp_path / f"{stem}.json"
    assert json.loads(outputs.files["json"].read_text()) == json.loads(json.dumps(results))
    assert outputs.files["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "latest_md" not in outputs.files  # smoke runs never replace the published table
    for key in ("mode", "load_average", "workload", "wall_seconds", *SECTIONS):
        assert key in results, key
    workload = workload_for("smoke")
    assert results["device"]["torch_threads"] == results["cpu_threads"] >= 1  # reached the child

    rollout = results["rollout"]
    most_tokens = workload.rollout_prompts * workload.rollout_n * workload.rollout_max_tokens
    for kind in ("vllm", "hf"):
        run = rollout[kind]
        assert 0 < run["new_tokens"] <= most_tokens
        assert run["tokens_per_s"] == pytest.approx(run["new_tokens"] / run["seconds"])
        assert run["memory"]["peak_gb"] >= run["memory"]["start_gb"] > 0
    assert rollout["vllm_over_hf"] == pytest.approx(
        rollout["vllm"]["tokens_per_s"] / rollout["hf"]["tokens_per_s"]
    )

    sync = results["sync"]["sizes"]
    assert [row["model"] for row in sync] == [shape.name for shape in workload.sync_models]
    for row, shape in zip(sync, workload.sync_models, strict=True):
        assert row["bytes"] == 4 * shape.num_params()  # fp32, every HF tensor once
        for path in ("reshard", "naive", "memcpy", "engine_reload"):
            assert row[path]["gbps"] == pytest.approx(row["bytes"] / row[path]["seconds"] / 1e9)

    train = results["train"]
    # The Megatron actor holds exactly the HF model's parameters (TP1, vocab unpadded).
    assert train["params"] == workload.train_model.num_params()
    assert train["tokens_per_step"] == (
        workload.train_micro_batches * workload.train_micro_batch_size * workload.train_seq_len
    )
    for key in ("megatron", "hf_baseline"):
        assert len(train[key]["step_seconds"]) == workload.train_steps
        assert len(train[key]["warmup_step_seconds"]) == workload.train_warmup_steps - 1
        assert train[key]["flops_per_s"] == pytest.approx(
            6 * train["params"] * train[key]["tokens_per_s"]
        )
        assert train[key]["mfu"] is None  # no data-sheet peak for a CPU
    # the core attentions side by side; the headline row is the one auto resolves to
    assert {"local", "sdpa"} <= set(train["attention_backends"])
    assert (
        train["megatron"]["tokens_per_s"]
        == train["attention_backends"][train["attention"]]["tokens_per_s"]
    )
    mixed = train["mixed_lengths"]
    assert mixed["packed"]["padded_fraction"] == 0  # packed rows hold real tokens only
    assert mixed["packed"]["computed_tokens"] == mixed["real_tokens"]
    for key in ("fixed", "token_budget", "packed"):
        run = mixed[key]
        assert run["computed_tokens"] >= mixed["real_tokens"]
        assert run["padded_fraction"] == pytest.approx(
            1 - mixed["real_tokens"] / run["computed_tokens"]
        )
    # Sorting by length never pads more than cutting in order.
    assert mixed["token_budget"]["padded_fraction"] <= mixed["fixed"]["padded_fraction"]

    lora = results["lora"]
    # The same model as the train section; rank-r adapters on every linear are all it trains.
    assert lora["params"] == train["params"] + lora["trainable_params"]
    shape, r = workload.train_model, lora["rank"]
    kv_out = shape.hidden_size // shape.num_heads * shape.num_kv_heads
    q = shape.hidden_size  # heads x head_dim
    h, f = shape.hidden_size, shape.intermediate_size
    per_layer = r * (h + q) + 2 * r * (h + kv_out) + r * (q + h) + 2 * r * (h + f) + r * (f + h)
    assert lora["trainable_params"] == shape.num_layers * per_layer
    assert lora["sync"]["adapter"]["bytes"] == 4 * lora["trainable_params"]  # fp32 A and B only
    assert lora["sync"]["merged"]["bytes"] == 4 * train["params"]  # every HF tensor once
    assert len(lora["update"]["step_seconds"]) == workload.train_steps

    grpo = results["grpo"]
    assert grpo["steps"] == workload.grpo_steps
    assert {"gen", "reward", "update", "sync", "other"} <= set(grpo["phases"])
    assert "old_log_prob" not in grpo["phases"]  # on-policy: the update's forward gives them
    assert len(grpo["plain_loop"]["step_seconds"]) == grpo["steps"] - 1
    assert set(grpo["phases"]) <= set(PHASE_LABELS)
    # Phases partition the step: a phase counted twice (nested timers) would exceed 100%.
    assert sum(p["share"] for p in grpo["phases"].values()) == pytest.approx(1.0)

    placement = results["placement"]
    assert placement["engine"] == workload.placement_engine == "hf"
    assert set(placement["runs"]) == {"colocated", "separate_sync", "separate_staleness_1"}
    for name, run in placement["runs"].items():
        assert run["steps"] == placement["steps"] == workload.placement_steps, name
        assert 0 <= run["trainer_idle_share"] <= 1 and 0 <= run["engine_idle_share"] <= 1, run
        assert run["accuracy_gain_per_s"] == pytest.approx(
            (run["accuracy_after"] - run["accuracy_before"]) / run["train_seconds"]
        )
    runs = placement["runs"]
    assert runs["colocated"]["staleness_max"] == runs["separate_sync"]["staleness_max"] == 0
    assert runs["separate_staleness_1"]["staleness_max"] <= 1
    assert placement["staleness_1_over_separate_sync"] == pytest.approx(
        runs["separate_staleness_1"]["steps_per_s"] / runs["separate_sync"]["steps_per_s"]
    )

    mismatch = results["mismatch"]
    assert list(mismatch["dense"]) == workload.mismatch_corrections == ["token_mis"]
    assert list(mismatch["moe"]) == workload.mismatch_replays == ["r3"]
    dense, moe = mismatch["dense"]["token_mis"], mismatch["moe"]["r3"]
    # a bf16 engine under the fp32 trainer: a mismatch, small; R3 measures the experts' share
    assert 0 < dense["logprob_diff"] < 0.1 and dense["kl_k3"] >= 0, dense
    assert 0 <= dense["masked_tokens"] <= 1 and 0 <= moe["routing_mismatch"] <= 1, (dense, moe)
    assert 0 <= moe["routing_replay_changed"] <= 1, moe

    recovery = results["recovery"]
    assert recovery["engine"] == workload.recovery_engine == "hf"
    [run] = recovery["runs"]  # a rank killed after step 2, the group restarted, step 3 done
    phases = ("detect_restart_s", "imports_s", "startup_s", "lost_step_s")
    assert all(run[phase] > 0 for phase in phases), run
    assert sum(run[phase] for phase in phases) == pytest.approx(run["total_s"])
    assert run["exit_code"] == 0, run

    table = outputs.files["md"].read_text()
    for fragment in ("| what | rlcli |", "rollout new tokens/s", "weight sync", "actor update tokens/s", "GRPO step",
                     "Peak memory per phase", "actor update with LoRA",
                     "LoRA weight sync into vLLM", "core attention, same batch",
                     "packed", "separate 1 + 1, staleness 1", "Trainer/engine mismatch",
                     "routing replay", "Recovery from a lost rank"):  # fmt: skip
        assert fragment in table, fragment


def test_command_runs_one_section_and_rejects_an_unknown_one(tmp_path):
    from typer.testing import CliRunner

    from benchmarks.__main__ import app

    runner = CliRunner()
    ran = runner.invoke(app, ["--smoke", "--section", "device", "--output-dir", str(tmp_path)])
    assert ran.exit_code == 0, ran.output
    results = json.loads(next(tmp_path.glob("*-smoke.json")).read_text())
    assert results["device"]["matmul_flops"] > 0
    assert "rollout" not in results and results["errors"] == {}

    wrong = runner.invoke(app, ["--smoke", "--section", "rollouts"])
    assert wrong.exit_code == 2, wrong.output
    assert "'rollouts' is not a section" in wrong.output and "--section" in wrong.output


def test_a_run_of_other_sections_has_no_empty_main_table():
    from benchmarks.report import markdown_table

    results = {"host": "vm", "date": "2026-12-06", "mode": "smoke", "device": {}}
    assert "| what | rlcli |" not in markdown_table(results)  # the full run's: smoke test above


def test_only_a_full_run_takes_the_days_report_name():
    """A run of some sections is named after them, so it never overwrites the full report of
    the day (nor latest.md, which only a full run replaces)."""
    assert report_stem("2026-12-02", "vm", False, SECTIONS) == "2026-12-02-vm"
    assert report_stem("2026-12-02", "vm", False, ["placement"]) == "2026-12-02-vm-placement"
    assert report_stem("2026-12-02", "vm", True, ["device"]) == "2026-12-02-vm-smoke"
    assert report_stem("2026-12-02", "vm", False, QUICK_SECTIONS) == "2026-12-02-vm-quick"
