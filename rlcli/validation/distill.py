"""On-policy distillation's settings (``distill.*``): what it needs and what it cannot use.

The teacher's tokenizer is checked against the student's when the teacher is built
(``rlcli.train.build.build_teacher``): reading it needs the student's tokenizer loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlcli.errors import UserError

if TYPE_CHECKING:
    from rlcli.config.schema import RLConfig


# vLLM's default ModelConfig.max_logprobs: the most prompt log-probs it returns a position.
VLLM_MAX_LOGPROBS = 20


def check_distill(cfg: RLConfig, world_size: int | None = None) -> None:
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

    if d.objective not in algorithms.distill_objective_names():
        raise UserError(
            f"distill.objective={d.objective!r} is not known; choose one of "
            f"{', '.join(algorithms.distill_objective_names())}"
        )
    check_top_k(cfg)
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
    check_teacher_engine(cfg, world_size)
    from parallel.convert import hf_model_dir_problem

    problem = hf_model_dir_problem(d.teacher_path)
    if problem is not None:
        raise UserError(
            f"distill.teacher_path={d.teacher_path}: {problem} (the teacher must exist before "
            "the run: train it, e.g. rlcli sft recipes/distill_teacher.yaml, or export one)"
        )


def check_top_k(cfg: RLConfig) -> None:
    """``distill.top_k`` belongs to a top-k objective, which needs padded micro-batches (and,
    on a vLLM teacher, no more tokens than vLLM returns)."""
    d = cfg.distill
    if not d.uses_top_k:
        if d.top_k is not None:
            raise UserError(
                f"distill.top_k={d.top_k} is read by a top-k objective only "
                f"(distill.objective=topk_forward_kl), not {d.objective}: drop distill.top_k"
            )
        return
    if d.teacher_top_k < 1:
        raise UserError(f"distill.top_k={d.teacher_top_k} must be >= 1")
    key = f"distill.objective={d.objective}"
    if cfg.actor.pack_sequences:
        raise UserError(
            f"{key} with actor.pack_sequences: the teacher's top-k tokens travel with padded "
            "rows only; set actor.pack_sequences=false (or distill.objective=reverse_kl)"
        )
    if d.teacher.engine == "vllm" and d.teacher_top_k > VLLM_MAX_LOGPROBS:
        raise UserError(
            f"distill.top_k={d.teacher_top_k} with distill.teacher.engine=vllm: vLLM gives at "
            f"most {VLLM_MAX_LOGPROBS} prompt log-probs a position (its max_logprobs); set "
            f"distill.top_k <= {VLLM_MAX_LOGPROBS}, or distill.teacher.engine=megatron"
        )


def check_teacher_engine(cfg: RLConfig, world_size: int | None) -> None:
    """``distill.teacher.*``: a Megatron teacher takes the actor's layout; an engine teacher has
    its own ``tp``, scores at temperature 1 and shares a process with the other engines."""
    from rlcli.validation.model import check_hf_engine

    d, t = cfg.distill, cfg.distill.teacher
    if t.engine == "megatron":
        if t.tp != 1:
            raise UserError(
                f"distill.teacher.tp={t.tp} is an engine teacher's (distill.teacher.engine=vllm "
                "or hf); a megatron teacher runs in the actor's layout (parallel.tp / pp)"
            )
        return
    key = f"distill.teacher.engine={t.engine}"
    if d.offload:
        raise UserError(
            f"distill.offload is the megatron teacher's; with {key} the engine sleeps outside "
            "its phase: drop distill.offload"
        )
    if cfg.rollout.is_separate:
        raise UserError(
            f"{key} with rollout.placement=separate is not supported: use "
            "distill.teacher.engine=megatron (the teacher on the trainer's ranks)"
        )
    if cfg.rollout.temperature != 1.0:
        raise UserError(
            f"{key} scores at temperature 1 and rollout.temperature={cfg.rollout.temperature:g}: "
            "the student's log-probs would be at another temperature than the teacher's; use "
            "distill.teacher.engine=megatron, or rollout.temperature=1"
        )
    check_hf_engine("distill.teacher", t)
    if t.tp < 1 or (world_size is not None and world_size % t.tp):
        raise UserError(f"distill.teacher.tp={t.tp} must be >= 1 and divide the world size")
    if t.engine == "vllm":
        # Every vLLM engine of a process shares vLLM's parallel groups and sleep allocator.
        for other, section in (("rollout", cfg.rollout), ("reward.judge", cfg.reward.judge)):
            in_use = other == "rollout" or bool(cfg.reward.judge.path)
            if in_use and section.engine == "vllm" and section.tp != t.tp:
                raise UserError(
                    f"distill.teacher.tp={t.tp} must equal {other}.tp={section.tp}: two vLLM "
                    "engines in one process share vLLM's tensor-parallel groups"
                )
        if cfg.rollout.engine == "vllm" and cfg.rollout.sleep_level != 1:
            raise UserError(
                "rollout.sleep_level=2 with a vLLM teacher: vLLM's sleep allocator is shared by "
                "every engine of a process; use rollout.sleep_level=1"
            )
