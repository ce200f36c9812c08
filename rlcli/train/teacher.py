"""On-policy distillation's teacher (``distill.*``): a frozen HF causal LM that scores the
student's sampled tokens in the step's ``teacher`` phase. Either on Megatron in the actor's layout
(``distill.teacher.engine=megatron``: a log-prob pass over this rank's share of the batch, after
``ref``), or on an inference engine of its own (``vllm`` / ``hf``: replicas of
``distill.teacher.tp`` ranks score every sample's tokens as prompt log-probs before the samples
are shared out, each replica a contiguous share, exchanged once; asleep outside its phase).

The teacher reads the student's token ids, so both must tokenise alike: the teacher's own
tokenizer (shipped in its folder) must have the student's vocabulary and special tokens, and its
embedding must cover every id. A mismatch would grade tokens the teacher never meant; it stops
the run before any model is built beyond the actor.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlcli.console import say
from rlcli.errors import UserError
from rlcli.model.trained_model import MicroBatching, TrainedModel
from rlcli.rollout.base import RolloutEngine
from rlcli.rollout.batch import RolloutBatch, Sample
from rlcli.rollout.factory import across_replicas, make_engine

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from parallel.model_options import ModelBuildOptions
    from rlcli.config.algorithm import DistillConfig
    from rlcli.train.inputs import RunInputs

# Any of these makes a folder's tokenizer loadable (fast, BPE vocab, sentencepiece); without one
# transformers may fall back to an empty tokenizer of the model's family.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")


def tokenizer_mismatch(teacher: PreTrainedTokenizerBase, student: PreTrainedTokenizerBase) -> str:
    """What differs between the two tokenizers ('' when they encode alike)."""
    teacher_vocab, student_vocab = teacher.get_vocab(), student.get_vocab()
    if teacher_vocab != student_vocab:
        differing = sorted(
            token
            for token in set(teacher_vocab) | set(student_vocab)
            if teacher_vocab.get(token) != student_vocab.get(token)
        )
        shown = ", ".join(repr(token) for token in differing[:3])
        return (
            f"the vocabularies differ ({len(teacher_vocab)} tokens vs the student's "
            f"{len(student_vocab)}; {len(differing)} tokens differ, e.g. {shown})"
        )
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(teacher, name) != getattr(student, name):
            return (
                f"{name} differs ({getattr(teacher, name)} vs the student's "
                f"{getattr(student, name)})"
            )
    return ""


def check_teacher_tokenizer(teacher_path: str, student: PreTrainedTokenizerBase) -> None:
    """A UserError naming ``distill.teacher_path`` unless the teacher tokenises as the student."""
    from transformers import AutoTokenizer

    key = f"distill.teacher_path={teacher_path}"
    if not any((Path(teacher_path) / name).exists() for name in TOKENIZER_FILES):
        raise UserError(
            f"{key}: the folder holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); save "
            "the student's tokenizer there (tokenizer.save_pretrained) so it can be compared"
        )
    try:
        teacher = AutoTokenizer.from_pretrained(teacher_path)
    except (OSError, ValueError) as err:
        raise UserError(
            f"{key}: its tokenizer does not load ({err}); the teacher's folder must hold the "
            "student's tokenizer files"
        ) from None
    mismatch = tokenizer_mismatch(teacher, student)
    if mismatch:
        raise UserError(
            f"{key}: the teacher's tokenizer is not the student's: {mismatch}. On-policy "
            "distillation scores the student's token ids with the teacher, so both must share "
            "one tokenizer (a teacher of the same model family)"
        )


def check_teacher(teacher_path: str, student: PreTrainedTokenizerBase, top_k: int = 0) -> None:
    """Before either teacher is built: it tokenises as the student, its embedding (its
    config.json's vocab_size) covers every id of the student's tokenizer, and it has the
    ``top_k`` tokens a top-k objective asks for."""
    from rlcli.rollout.base import read_hf_config

    check_teacher_tokenizer(teacher_path, student)
    vocab = read_hf_config(teacher_path, "distill.teacher").get("vocab_size", 0)
    if vocab < len(student):
        raise UserError(
            f"distill.teacher_path={teacher_path} has vocab_size {vocab}, fewer than the "
            f"student's tokenizer ({len(student)} tokens): the teacher reads the student's ids"
        )
    if top_k > vocab:
        raise UserError(
            f"distill.top_k={top_k} is more than the teacher's vocabulary ({vocab} tokens): "
            "set distill.top_k <= the vocabulary size"
        )


def build_teacher(inputs: RunInputs, options: ModelBuildOptions) -> TrainedModel:
    """The frozen teacher of ``distill.teacher_path``: no optimizer, the actor's micro-batches,
    the layout ``options`` of the reference."""
    cfg, mesh = inputs.cfg, inputs.mesh
    path = cfg.distill.teacher_path
    assert path is not None and mesh is not None  # validated; trainer ranks only
    check_teacher(path, inputs.tokenizer, cfg.distill.teacher_top_k)
    say(mesh, f"building the distillation teacher (tp={mesh.tp} pp={mesh.pp}) from {path}")
    teacher = TrainedModel(
        mesh,
        path,
        dtype=cfg.model.dtype,
        micro_batching=MicroBatching.of(cfg.actor),
        model_options=options,
    )
    return teacher


def teacher_pass(
    teacher: TrainedModel, batch: RolloutBatch, distill: DistillConfig, temperature: float
) -> None:
    """The Megatron teacher's phase: the sampled tokens' log-probs (``teacher_log_probs``) and,
    for a top-k objective, every position's ``distill.top_k`` likeliest tokens
    (``teacher_top_log_probs``, and their ids as ``scored_ids`` for the update's forward)."""
    if not distill.uses_top_k:
        batch.teacher_log_probs = teacher.forward(batch, temperature)
        return
    batch.teacher_log_probs, batch.teacher_top_log_probs, batch.scored_ids = teacher.forward_top(
        batch, temperature, distill.teacher_top_k
    )


class TeacherEngine:
    """The teacher on an inference engine (see the module docstring); ``top_k`` > 0: it also
    gives every response position's ``top_k`` likeliest tokens (a top-k objective)."""

    def __init__(self, engine: RolloutEngine, top_k: int = 0) -> None:
        self.engine = engine
        self.top_k = top_k

    def score(self, samples: list[Sample]) -> None:
        """Fill every sample's ``teacher_log_probs`` (its response tokens') and, with ``top_k``,
        its ``teacher_top_log_probs`` / ``teacher_top_ids``, on every rank (collective: every
        rank calls it with the same samples)."""
        scored = across_replicas(
            self.engine,
            len(samples),
            lambda mine: self.engine.sequence_log_probs(
                [samples[i].prompt_ids + samples[i].response_ids for i in mine], self.top_k
            ),
        )
        for sample, sequence in zip(samples, scored, strict=True):
            # position p of a sequence scores token p + 1: the response starts at the prompt's end
            first = len(sample.prompt_ids) - 1
            sample.teacher_log_probs = sequence.log_probs[first:]
            if self.top_k:
                sample.teacher_top_log_probs = sequence.top_log_probs[first:]
                sample.teacher_top_ids = sequence.top_ids[first:]

    def close(self) -> None:
        self.engine.close()


def build_teacher_engine(inputs: RunInputs) -> TeacherEngine:
    """The engine teacher of ``distill.teacher.*`` over ``distill.teacher_path`` (tokenizer and
    vocabulary checked as for a Megatron teacher), asleep until its phase."""
    from rlcli.rollout.trajectory import response_limit

    cfg = inputs.cfg
    path, teacher = cfg.distill.teacher_path, cfg.distill.teacher
    assert path is not None  # validated
    top_k = cfg.distill.teacher_top_k
    check_teacher(path, inputs.tokenizer, top_k)
    say(
        inputs.mesh,
        f"starting the distillation teacher's {teacher.engine} engine (tp={teacher.tp}) on {path}",
    )
    engine = make_engine(
        teacher,
        path,
        dtype=cfg.model.dtype,
        seed=cfg.trainer.seed,
        max_model_len=teacher.max_model_len or (cfg.data.max_prompt_length + response_limit(cfg)),
        key="distill.teacher",
    )
    engine.sleep()  # woken for the teacher phase only
    return TeacherEngine(engine, top_k)
