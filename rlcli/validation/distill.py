"""On-policy distillation's settings (``distill.*``): what it needs and what it cannot use.

The teacher's tokenizer is checked against the student's when the teacher is built
(``rlcli.train.build.build_teacher``): reading it needs the student's tokenizer loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlcli.errors import UserError

if TYPE_CHECKING:
    from rlcli.config.schema import RLConfig


def check_distill(cfg: RLConfig) -> None:
    """A UserError naming the key when ``distill.*`` is incomplete, out of range or combined
    with a setting it would silently ignore."""
    d = cfg.distill
    if not d.enable:
        if d.teacher_path:
            raise UserError(
                f"distill.teacher_path={d.teacher_path} is set but distill.enable=false: set "
                "distill.enable=true to distil from it, or drop distill.teacher_path"
            )
        return
    if not d.teacher_path:
        raise UserError(
            "distill.enable=true needs distill.teacher_path: the HF folder of the teacher model "
            "(a causal LM with the student's tokenizer)"
        )
    import algorithms

    try:
        algorithms.get_distill_objective(d.objective)
    except ValueError as err:
        raise UserError(f"distill.objective: {err}") from None
    if d.kl_coef <= 0:
        raise UserError(f"distill.kl_coef={d.kl_coef:g} makes no sense: it must be > 0")
    if d.reward_weight < 0:
        raise UserError(
            f"distill.reward_weight={d.reward_weight:g} makes no sense: it must be >= 0"
        )
    if d.reward_weight == 0:
        unused = [
            key
            for key, used in (
                ("algorithm.adv_estimator=gae (a critic)", cfg.algorithm.uses_critic),
                ("algorithm.dynamic_sampling.enabled", cfg.algorithm.dynamic_sampling.enabled),
                ("algorithm.use_kl_in_reward", cfg.algorithm.use_kl_in_reward),
                ("algorithm.overlong.enabled", cfg.algorithm.overlong.enabled),
            )
            if used
        ]
        if unused:
            raise UserError(
                f"{', '.join(unused)} shape the task reward, which distill.reward_weight=0 "
                "leaves out of the advantage (pure distillation): set distill.reward_weight > 0 "
                "to mix the task reward in, or turn these off"
            )
    from parallel.convert import hf_model_dir_problem

    problem = hf_model_dir_problem(d.teacher_path)
    if problem is not None:
        raise UserError(
            f"distill.teacher_path={d.teacher_path}: {problem} (the teacher must exist before "
            "the run: train it, e.g. rlcli sft recipes/distill_teacher.yaml, or export one)"
        )
