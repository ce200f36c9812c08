"""LoRA settings of a run: `actor.lora.*` / `rollout.lora_sync` checked before any work (exit 2
naming the key), the residency plan (the reference is the actor: its `ref` row needs the actor's
params), the resume check, and `rlcli plan`'s LoRA memory against counts worked by hand."""

from __future__ import annotations

import dataclasses

import pytest

from parallel.model_shapes import KNOWN_SHAPES, LORA_TARGET_MODULES, lora_stage_params
from rlcli.config.schema import LoraConfig, choices
from rlcli.errors import UserError
from rlcli.model.lora import check_resumed_lora, lora_spec, lora_state, spec_of_state
from rlcli.model.residency import Need, residency_plan
from rlcli.run.state import RunState
from rlcli.validation.loader import load_config
from tests.rlcli.test_cli_errors import QUICKSTART, assert_exit_2, rlcli
from tests.rlcli.test_plan import SEVEN_B, run_cli


def test_target_module_choices_are_the_linears_that_take_adapters():
    assert choices(LoraConfig, "target_modules") == ("all", *LORA_TARGET_MODULES)


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["actor.lora.rank=0"], ["actor.lora.rank=0 must be a positive integer"]),
        (["actor.lora.rank=-4"], ["actor.lora.rank=-4"]),
        (["actor.lora.alpha=0"], ["actor.lora.alpha=0"]),
        (["actor.lora.dropout=1.0"], ["actor.lora.dropout=1.0", "[0, 1)"]),
        # an HF module name where a Megatron linear is asked for: the choices are listed
        (["actor.lora.target_modules=[q_proj]"], ["actor.lora.target_modules", "linear_qkv"]),
        (
            ["rollout.engine=hf", "rollout.lora_sync=adapter"],
            ["rollout.lora_sync=adapter", "hf engine cannot apply LoRA adapters", "merged"],
        ),
        (
            ["actor.lora.enable=false", "rollout.lora_sync=adapter"],
            ["rollout.lora_sync=adapter", "actor.lora.enable=false"],
        ),
        (["actor.lora.adapter_path=/no/such/adapter"], ["actor.lora.adapter_path", "no such"]),
        (
            ["model.transformer_impl=transformer_engine"],
            ["actor.lora", "model.transformer_impl=local"],
        ),
    ],
)
def test_bad_lora_settings_are_exit_2_before_any_work(tmp_path, overrides, needles):
    run = tmp_path / "run"
    proc = rlcli(
        "train", QUICKSTART, f"trainer.output_dir={run}", "actor.lora.enable=true", *overrides
    )
    assert_exit_2(proc, *needles)
    assert not run.exists()  # nothing was built


def test_the_reference_of_a_lora_actor_is_the_actor():
    params = Need(on=frozenset({"params"}))
    full = residency_plan(load_config(QUICKSTART, ["actor.use_kl_loss=true"]))
    assert full["ref"]["reference"] == params and "actor" not in full["ref"]
    lora = residency_plan(
        load_config(QUICKSTART, ["actor.use_kl_loss=true", "actor.lora.enable=true"])
    )
    assert lora["ref"]["actor"] == params and "reference" not in lora["ref"]
    assert {k: v for k, v in lora["ref"].items() if k != "actor"} == {
        k: v for k, v in full["ref"].items() if k != "reference"
    }
    assert {phase: row for phase, row in lora.items() if phase != "ref"} == {
        phase: row for phase, row in full.items() if phase != "ref"
    }


def test_a_resume_continues_the_same_kind_of_actor(tmp_path):
    cfg = load_config(QUICKSTART, ["actor.lora.enable=true", "actor.lora.rank=8"])
    spec = lora_spec(cfg.actor.lora, seed=3)
    state = lora_state(spec)
    # ["all"] is recorded as the linears it stands for
    assert spec_of_state(RunState(lora=state)) == dataclasses.replace(
        spec, target_modules=spec.targets()
    )
    assert spec_of_state(RunState()) is None  # checkpoints of full fine-tuning
    check_resumed_lora(tmp_path, state, dict(state))
    check_resumed_lora(tmp_path, None, None)
    with pytest.raises(UserError, match="actor.lora.rank=8 to continue"):
        check_resumed_lora(tmp_path, state, {**state, "rank": 16})
    with pytest.raises(UserError, match=r"actor.lora.target_modules=\[linear_qkv\]"):
        check_resumed_lora(tmp_path, {**state, "target_modules": ["linear_qkv"]}, state)
    with pytest.raises(UserError, match="fully fine-tuned actor"):
        check_resumed_lora(tmp_path, None, state)
    with pytest.raises(UserError, match="actor.lora.enable=true"):
        check_resumed_lora(tmp_path, state, None)


def test_plan_of_the_7b_recipe_with_lora(capsys):
    from parallel.memory_terms import TrainedModel, grad_bytes, optimizer_bytes

    code, full_out, _ = run_cli(capsys, *SEVEN_B)
    assert code == 0, full_out
    code, out, _ = run_cli(capsys, *SEVEN_B, "actor.lora.enable=true", "actor.lora.rank=32")
    assert code == 0, out
    shape = KNOWN_SHAPES["qwen2.5-7b"]
    # Hand count of rank-32 adapters at TP4 on one layer: column-parallel q, k, v, gate, up keep A
    # [32, 3584] whole and B's rows / 4; row-parallel o, down split A's columns / 4, B whole.
    q, kv, ffn, h, r = 3584, 512, 18944, 3584, 32
    column = sum(r * h + out // 4 * r for out in (q, kv, kv, ffn, ffn))
    row = r * q // 4 + h * r + r * ffn // 4 + h * r
    per_rank = 28 * (column + row)
    assert lora_stage_params(shape, tp=4, pp=1, rank=32, target_modules=LORA_TARGET_MODULES) == (
        per_rank
    )
    actor = TrainedModel(shape, tp=4, dp=4, distributed_optimizer=True, lora_rank=32)
    assert grad_bytes(actor) == 4 * per_rank  # fp32 gradient buffer of the adapters only
    assert optimizer_bytes(actor) == 4 * 3 * -(-per_rank // 4)  # master + 2 moments, over DP 4
    assert f"{per_rank / 1e6:.1f} M trainable params per GPU" in out
    assert "ref weights" in full_out and "ref weights" not in out  # no reference model
    line = next(x for x in out.splitlines() if x.startswith("  vs full fine-tuning"))
    assert "GiB freed per GPU" in line
    assert "parallel.tp=1: peak" in out and "does NOT fit" in out  # full FT needs TP >= 2
