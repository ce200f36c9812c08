"""On-policy distillation's settings and teacher checks: bad input stops with exit 2 naming the
key, and a teacher must tokenise exactly as the student does. (The step itself, a teacher equal
to the student leaving the weights unchanged and a moved student learning, runs in
``test_algorithms_e2e.py``.)"""

from __future__ import annotations

import re

import pytest

from rlcli.errors import UserError
from rlcli.model.builder import train_tokenizer
from rlcli.train.teacher import check_teacher_tokenizer
from rlcli.validation.loader import load_config
from tests.rlcli.test_config import QUICKSTART, run_cli

CORPUS = [f"Question: {a} + {b} = ? Answer: #### {a + b}" for a in range(30) for b in range(9)]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A folder that passes as an HF model folder (config.json, weights) with the arith tokenizer."""
    from tests.parallel.dist_utils import make_tiny_hf_model

    root = tmp_path_factory.mktemp("teacher")
    tokenizer = train_tokenizer(CORPUS, 300)
    folder = make_tiny_hf_model(root / "model", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["distill.enable=true"], "distill.enable=true needs distill.teacher_path"),
        (["distill.teacher_path=/x"], "distill.teacher_path=/x is set but distill.enable=false"),
        (
            ["distill.enable=true", "distill.teacher_path=/nowhere/teacher"],
            "distill.teacher_path=/nowhere/teacher: ",
        ),
        (
            ["distill.objective=forward_kl"],
            "distill.objective='forward_kl' is not known; choose one of reverse_kl, "
            "topk_forward_kl",
        ),
        (["distill.top_k=4"], "distill.top_k=4 is read by a top-k objective only"),
        (
            ["distill.objective=topk_forward_kl", "distill.top_k=0"],
            "distill.top_k=0 must be >= 1",
        ),
        (
            ["distill.objective=topk_forward_kl", "actor.pack_sequences=true"],
            "distill.objective=topk_forward_kl with actor.pack_sequences",
        ),
        (
            [
                "distill.objective=topk_forward_kl",
                "distill.teacher.engine=vllm",
                "distill.top_k=32",
            ],
            "distill.top_k=32 with distill.teacher.engine=vllm: vLLM gives at most 20",
        ),
        (["distill.kl_coef=0"], "distill.kl_coef=0 makes no sense: it must be > 0"),
        (["distill.reward_weight=-1"], "distill.reward_weight=-1 makes no sense"),
        (
            ["algorithm.dynamic_sampling.enabled=true"],
            "algorithm.dynamic_sampling.enabled shape the task reward, which "
            "distill.reward_weight=0 leaves out",
        ),
        (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator=gae (a critic)"),
        (["distill.teacher.tp=2"], "distill.teacher.tp=2 is an engine teacher's"),
        (
            ["distill.teacher.engine=hf", "distill.offload=true"],
            "distill.offload is the megatron teacher's",
        ),
        (
            ["distill.teacher.engine=vllm", "rollout.temperature=0.7"],
            "distill.teacher.engine=vllm scores at temperature 1 and rollout.temperature=0.7",
        ),
        (["distill.teacher.engine=hf", "distill.teacher.tp=2"], "distill.teacher.engine=hf runs"),
        (
            ["distill.teacher.engine=vllm", "distill.teacher.tp=2"],
            "distill.teacher.tp=2 must equal rollout.tp=1",
        ),
    ],
)
def test_bad_distill_settings_name_the_key(overrides, message, teacher_dir):
    base = ["distill.enable=true", f"distill.teacher_path={teacher_dir}"]
    if overrides[0].startswith(("distill.enable", "distill.teacher_path")):
        base = []
    with pytest.raises(UserError, match=re.escape(message)):
        load_config(QUICKSTART, [*base, "algorithm.dynamic_sampling.enabled=false", *overrides])


def test_good_settings_load_and_mix_the_task_reward_in(teacher_dir):
    cfg = load_config(
        QUICKSTART,
        ["distill.enable=true", f"distill.teacher_path={teacher_dir}", "distill.reward_weight=1"],
    )
    assert cfg.algorithm.dynamic_sampling.enabled  # the task reward is used: DAPO's filter fits


def test_the_cli_refuses_a_missing_teacher_with_exit_2():
    proc = run_cli("config", "validate", str(QUICKSTART), "distill.enable=true")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "distill.teacher_path" in proc.stderr and "Traceback" not in proc.stderr


def test_a_teacher_with_the_students_tokenizer_passes(teacher_dir):
    # The tokenizer is trained from the task text alone: a larger model of the same task has it.
    check_teacher_tokenizer(str(teacher_dir), train_tokenizer(CORPUS, 300))


def test_a_teacher_with_another_tokenizer_is_refused(teacher_dir):
    other = train_tokenizer([text.replace("Answer", "Reply") for text in CORPUS], 300)
    with pytest.raises(UserError, match="the teacher's tokenizer is not the student's") as info:
        check_teacher_tokenizer(str(teacher_dir), other)
    assert f"distill.teacher_path={teacher_dir}" in str(info.value)
    assert "vocabularies differ" in str(info.value)


def test_a_teacher_without_a_tokenizer_is_refused(tmp_path):
    from tests.parallel.dist_utils import make_tiny_hf_model

    folder = make_tiny_hf_model(tmp_path / "bare")
    with pytest.raises(UserError, match="holds no tokenizer files"):
        check_teacher_tokenizer(str(folder), train_tokenizer(CORPUS, 300))


def test_the_quickstart_recipes_load(teacher_dir):
    from pathlib import Path

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    teacher = load_config(recipes / "distill_teacher.yaml", [])
    assert teacher.sft.steps > 0 and teacher.model.spec.hidden_size == 256
    student = load_config(
        recipes / "distill_quickstart.yaml", [f"distill.teacher_path={teacher_dir}"]
    )
    assert student.distill.enable and student.distill.reward_weight == 0
    # the student's tokenizer is built like the teacher's: same task text, same vocabulary size
    assert student.model.spec.vocab_size == teacher.model.spec.vocab_size
    assert student.data.synthetic == teacher.data.synthetic
    grpo = load_config(
        recipes / "distill_quickstart.yaml", ["distill.enable=false", "distill.teacher_path=null"]
    )
    assert not grpo.distill.enable


@pytest.mark.dist
@pytest.mark.vllm
def test_a_tp2_vllm_teacher_grades_a_tp1_student(tmp_path):
    """Two processes: the student trains at TP1 x DP2 (HF rollout engine), the teacher is a vLLM
    engine at TP2 over the student's own start weights, the top-k objective (vLLM's top 8 prompt
    log-probs a position): at step 1 the two agree to rounding (the engine's prompt log-probs
    equal Megatron's, sampled tokens and top 8 alike), at step 2 the student has moved."""
    from tests.rlcli.arith_model import build_arith_model
    from tests.rlcli.test_train_e2e import records, train

    # the TINY spec of the end-to-end runs, built first: the teacher must exist at validation
    spec = {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2}
    model = build_arith_model(tmp_path, **spec, intermediate_size=128)
    out = tmp_path / "run"
    train(
        out,
        f"model.path={model}",
        "rollout.engine=hf",
        "distill.enable=true",
        f"distill.teacher_path={model}",
        "distill.teacher.engine=vllm",
        "distill.teacher.tp=2",
        "distill.teacher.kv_cache_gb=0.05",
        "distill.objective=topk_forward_kl",
        "distill.top_k=8",
        "trainer.total_steps=2",
        "checkpoint.save_freq=0",
    )
    first, second = [r for r in records(out) if r["step"] > 0]
    assert abs(first["distill/reverse_kl"]) < 1e-4 and first["distill/reverse_kl_k3"] < 1e-6
    assert second["distill/reverse_kl_k3"] > 1e-6, second
    assert abs(first["actor/distill_loss"]) < 1e-5 < second["actor/distill_loss"], (first, second)
    assert "timing/teacher" in first and "timing/ref" not in first
