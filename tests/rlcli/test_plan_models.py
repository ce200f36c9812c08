"""`rlcli plan` and parallel.memory_plan for the other models of a run: a reward model (its score
head against transformers' count), a judge engine and a distillation teacher, each counted in the
phases it is resident."""

from __future__ import annotations

import dataclasses

import torch

from parallel.memory_plan import PlanInputs, RolloutEngine, plan_memory
from parallel.memory_terms import GB, TrainedModel, weight_bytes
from parallel.model_shapes import KNOWN_SHAPES, max_stage_params
from tests.rlcli.test_plan import _hf_config, run_cli


def test_a_score_head_counts_what_transformers_builds():
    """A reward model's score head is one weight vector, no bias (Qwen2ForSequenceClassification
    with one label), unlike PPO's value head."""
    from transformers import Qwen2ForSequenceClassification

    shape = KNOWN_SHAPES["qwen2.5-0.5b"]
    config, _ = _hf_config(shape)
    assert type(config).__name__ == "Qwen2Config"  # (qkv bias)
    config.num_labels = 1
    with torch.device("meta"):
        model = Qwen2ForSequenceClassification(config)
    hf_count = sum(p.numel() for p in model.parameters())
    assert max_stage_params(shape, tp=1, pp=1, critic=True, head_bias=False) == hf_count
    assert max_stage_params(shape, tp=1, pp=1, critic=True) == hf_count + 1  # the value head's


def test_the_reward_model_and_the_judge_are_counted_where_resident():
    from parallel.memory_plan import JudgeEngine
    from parallel.memory_terms import forward_only_bytes

    actor = TrainedModel(KNOWN_SHAPES["qwen2.5-7b"], tp=4, dp=4)
    reward_model = dataclasses.replace(
        actor, shape=KNOWN_SHAPES["qwen2.5-1.5b"], critic=True, head_bias=False
    )
    judge_shape = KNOWN_SHAPES["qwen2.5-0.5b"]
    inputs = PlanInputs(actor, RolloutEngine(tp=2), 80 * GB, reward_model=reward_model)
    assert "reward" not in plan_memory(dataclasses.replace(inputs, reward_model=None)).phases

    plan = plan_memory(inputs)
    weights = weight_bytes(reward_model)  # held in every phase unless offloaded
    assert all(p.terms["reward model weights"] == weights for p in plan.phases.values())
    assert plan.phases["reward"].terms["reward model forward"] == forward_only_bytes(
        reward_model, reward_model.micro_batch_size
    )
    offloaded = plan_memory(dataclasses.replace(inputs, reward_model_offload=True))
    assert [n for n, p in offloaded.phases.items() if "reward model weights" in p.terms] == [
        "reward"
    ]

    # A vLLM judge next to a vLLM rollout engine shares its sleep allocator: awake with it.
    judge = JudgeEngine(judge_shape, tp=2, gpu_memory_utilization=0.2)
    plan = plan_memory(dataclasses.replace(inputs, judge=judge))
    budget = int(0.2 * 80 * GB)
    key = "judge vLLM (gpu_memory_utilization)"
    assert {n for n, p in plan.phases.items() if key in p.terms} == {"generate", "reward"}
    assert plan.phases["reward"].terms[key] == budget
    assert "vLLM (gpu_memory_utilization)" in plan.phases["reward"].terms  # woken with it
    weights = max_stage_params(judge_shape, tp=2, pp=1) * 2
    assert plan.phases["sync"].terms["judge vLLM weights"] == weights
    # Next to an HF rollout engine only the judge wakes for its phase; an HF judge never sleeps.
    alone = plan_memory(dataclasses.replace(inputs, judge=judge, rollout_vllm=False))
    assert {n for n, p in alone.phases.items() if key in p.terms} == {"reward"}
    hf_judge = dataclasses.replace(judge, vllm=False)
    hf = plan_memory(dataclasses.replace(inputs, judge=hf_judge))
    assert all(p.terms["judge weights (HF)"] == weights for p in hf.phases.values())


def test_plan_shows_the_reward_phase_of_an_rlhf_recipe(capsys, tmp_path):
    output = f"trainer.output_dir={tmp_path}"  # the reward model is not trained yet
    code, out, _ = run_cli(
        capsys, "plan", "recipes/rlhf_quickstart.yaml", output, "--gpus-per-node", "1"
    )
    assert code == 0, out
    head = next(line for line in out.splitlines() if line.startswith("per GPU"))
    assert head.split()[3:] == ["generate", "reward", "log_probs", "update", "sync"], head
    assert "reward model weights" in out and "reward model forward" in out


def test_a_distillation_teacher_is_counted_where_resident():
    """A 7B teacher for a 1.5B student: its weights (its own shape, the student's layout) in every
    phase, or only in the log-prob phase with distill.offload; its forward may set the working
    set."""
    from parallel.memory_terms import forward_only_bytes

    student = TrainedModel(KNOWN_SHAPES["qwen2.5-1.5b"], tp=2, dp=4)
    teacher = dataclasses.replace(student, shape=KNOWN_SHAPES["qwen2.5-7b"])
    inputs = PlanInputs(student, RolloutEngine(tp=2), 80 * GB, teacher=teacher)
    plan = plan_memory(inputs)
    weights = weight_bytes(teacher)
    assert weights > weight_bytes(student)
    assert all(p.terms["teacher weights"] == weights for p in plan.phases.values())
    assert plan.phases["log_probs"].terms["forward working set"] == forward_only_bytes(
        teacher, teacher.micro_batch_size
    )
    offloaded = plan_memory(dataclasses.replace(inputs, teacher_offload=True))
    assert [n for n, p in offloaded.phases.items() if "teacher weights" in p.terms] == ["log_probs"]
    without = plan_memory(dataclasses.replace(inputs, teacher=None))
    assert plan.phases["update"].total - without.phases["update"].total == weights
