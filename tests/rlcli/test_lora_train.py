"""`rlcli train` with a LoRA actor (actor.lora), end to end: real runs of the tiny quickstart model.

* merged sync into vLLM at TP2 (torchrun): the engine's sampled-token log-probs match the
  trainer's as in the full-parameter case, the reference is the base (KL 0 while B = 0), the
  checkpoint holds only adapters; `rlcli export --lora` writes a folder PEFT loads whose logits
  are the trained policy's, `--merge` a model equal to PEFT's merge_and_unload;
* adapter sync into vLLM (the engine starts with dummy weights: the first sync sends the base),
  with on-policy distillation from the base model (a LoRA student: its adapters learn the
  teacher's top-k loss beside the task reward);
* resume == uninterrupted (adapter dropout on, so the RNG streams must resume too);
* bad input: a starting adapter whose shapes do not fit the model, exit 2.

The model-level checks (PEFT parity at TP2 / PP2 / DP2, gradients only on adapters, B = 0 is the
base) are tests/parallel/test_lora.py's.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.parallel.dist_utils import make_tiny_hf_model
from tests.rlcli.test_run_survival import (
    _resume_equals_uninterrupted,
    checkpoint_tensors,
    finish,
    rlcli_train,
    rows,
    total_steps,
)
from tests.rlcli.test_train_e2e import REPO, check_step_metrics, records, train

WORKER = Path(__file__).with_name("lora_export_worker.py")
LORA = ["actor.lora.enable=true", "actor.lora.rank=8", "actor.lora.alpha=16"]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="no vLLM")


def rlcli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlcli.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


def only_adapters_saved(step_dir: Path, tmp: Path) -> None:
    """The checkpoint's model/ holds adapter tensors and their Adam moments, nothing of the base."""
    tensors = checkpoint_tensors(step_dir, tmp)
    assert tensors, step_dir
    assert all("_lora." in name for name in tensors), sorted(tensors)[:5]
    assert any(name.startswith("optimizer.") for name in tensors), sorted(tensors)[:5]


def adapter_bytes(hidden: int, ffn: int, q: int, kv: int, layers: int, rank: int) -> int:
    """fp32 bytes of A [r, in] + B [out, r] of every HF module (q, k, v, o, gate, up, down)."""
    modules = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden)]
    modules += [(hidden, ffn), (hidden, ffn), (ffn, hidden)]
    return 4 * layers * sum(rank * (fan_in + fan_out) for fan_in, fan_out in modules)


@pytest.mark.dist
@pytest.mark.vllm
@needs_vllm
def test_merged_sync_at_tp2_checkpoint_and_exports(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    # Rewards that vary within every group: step 1's update surely moves the adapters.
    reward = tmp_path / "hash_reward.py"
    reward.write_text(
        "import zlib\n\n\ndef compute_score(data_source, solution_str, ground_truth, "
        "extra_info=None):\n    return zlib.crc32(solution_str.encode()) % 100 / 100\n"
    )
    overrides = [*LORA, "actor.lora.dropout=0.1", "actor.use_kl_loss=true"]
    overrides += [f"reward.fn={reward}:compute_score"]
    train(out, "parallel.tp=2", "rollout.engine=vllm", "trainer.total_steps=2", *overrides)
    steps = records(out)
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        # Also proves the no-grad passes ran without adapter dropout (the agreement is measured
        # on the old-log-prob pass: 2 mini-batches per step).
        check_step_metrics(record)
    # The reference is the base: at step 1 (B = 0) the policy is the base exactly; after the
    # adapters moved it is not.
    assert steps[0]["actor/kl_to_ref"] == 0.0 and steps[0]["actor/grad_norm"] > 0
    assert steps[1]["actor/kl_to_ref"] > 0.0
    step_dir = out / "checkpoints" / "step_000002"
    only_adapters_saved(step_dir, tmp_path)
    state = json.loads((step_dir / "trainer_state.json").read_text())
    assert state["lora"]["rank"] == 8 and state["model_dir"] == str(out / "model")

    # Exit 2 naming what to do: a LoRA checkpoint exports as adapters or merged.
    plain = rlcli("export", str(step_dir), "--out", str(tmp_path / "plain"))
    assert plain.returncode == 2 and "--lora" in plain.stderr and "--merge" in plain.stderr
    both = rlcli("export", str(step_dir), "--out", str(tmp_path / "x"), "--lora", "--merge")
    assert both.returncode == 2 and "choose one" in both.stderr

    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    for flag, folder in (("--lora", adapter_dir), ("--merge", merged_dir)):
        proc = rlcli("export", str(step_dir), "--out", str(folder), flag)
        assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(out / "model")
    assert config["r"] == 8 and config["lora_alpha"] == 16

    vocab = json.loads((out / "model" / "config.json").read_text())["vocab_size"]
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    subprocess.run(
        [sys.executable, str(WORKER), str(step_dir), tmp_path / "tokens.pt", tmp_path / "mg.pt"],
        cwd=REPO,
        check=True,
        timeout=600,
    )
    megatron = torch.load(tmp_path / "mg.pt")
    assert megatron["largest_b"] > 1e-4  # trained adapters, not the B = 0 start
    base = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        peft_logits = peft_model(input_ids=tokens).logits
    assert (peft_logits - megatron["logits"]).abs().max().item() < 1e-5

    merged = peft_model.merge_and_unload().state_dict()
    exported = load_file(merged_dir / "model.safetensors")
    assert set(exported) <= set(merged) and set(merged) - set(exported) <= {"lm_head.weight"}
    for name, tensor in exported.items():
        assert (tensor - merged[name]).abs().max().item() < 1e-6, name
    assert json.loads((merged_dir / "config.json").read_text())["model_type"] == "qwen2"


@pytest.mark.vllm
@needs_vllm
def test_adapter_sync_sends_only_adapters_and_the_engine_agrees(tmp_path):
    from tests.rlcli.arith_model import build_arith_model

    # The TINY model, built first: it is also the distillation teacher, which must exist at
    # validation. At step 1 the student (B = 0) is the teacher: no top-k loss; then its adapters
    # have moved (the task reward's share).
    base = build_arith_model(
        tmp_path, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128
    )
    out = tmp_path / "run"
    # load_format=dummy (the default): the engine starts with random weights, so agreement at
    # step 1 also proves the first sync sent the base before the adapter.
    code, output = finish(
        rlcli_train(
            out,
            *LORA,
            f"model.path={base}",
            "rollout.engine=vllm",
            "rollout.lora_sync=adapter",
            "distill.enable=true",
            f"distill.teacher_path={base}",
            "distill.objective=topk_forward_kl",
            "distill.reward_weight=1",
            "actor.ppo_mini_batch_size=4",  # one optimizer step a step: step 1 is all at B = 0
            "trainer.total_steps=2",
            "checkpoint.save_freq=0",
        )
    )
    assert code == 0, output[-3000:]
    steps = rows(out)
    assert [r["step"] for r in steps] == [1, 2]
    # TINY: hidden 128, 2 heads of 64 (q 128, kv 128), ffn 128, 2 layers; rank 8, fp32.
    expected = adapter_bytes(hidden=128, ffn=128, q=128, kv=128, layers=2, rank=8)
    for record in steps:
        check_step_metrics(record)
        assert record["sync/bytes_gb"] == pytest.approx(expected / 1e9, rel=1e-12)
    first, second = steps
    # (a divergence, up to float rounding of either sign)
    assert abs(first["actor/distill_loss"]) < 1e-7 and second["actor/distill_loss"] > 1e-6, steps
    assert abs(first["distill/reverse_kl"]) < 1e-5 and "timing/teacher" in first


def test_resume_equals_uninterrupted_with_lora_dropout(tmp_path):
    _resume_equals_uninterrupted(
        tmp_path, *LORA, "actor.lora.dropout=0.1", "actor.use_kl_loss=true", sigterm=False
    )
    last = f"step_{total_steps(sigterm=False):06d}"
    only_adapters_saved(tmp_path / "whole" / "checkpoints" / last, tmp_path)


def test_a_starting_adapter_of_another_shape_is_exit_2(tmp_path):
    from tests.parallel.test_lora import make_peft_adapter

    # The run's model: hidden 128, 2 layers; this one: hidden 64, 2 layers (the same tensor names).
    other = make_tiny_hf_model(tmp_path / "other", "qwen2", num_hidden_layers=2)
    adapter = make_peft_adapter(other, tmp_path / "adapter", r=8, alpha=16)
    out = tmp_path / "run"
    code, output = finish(
        rlcli_train(out, *LORA, f"actor.lora.adapter_path={adapter}", "trainer.total_steps=1")
    )
    assert code == 2, output[-3000:]
    assert "Traceback" not in output
    assert f"actor.lora.adapter_path={str(adapter)!r}" in output
    assert "has shape" in output and "is the adapter for this model?" in output
