"""On-policy preference pairs for the reward model (``rm.on_policy_samples``, ``rlcli train``).

A reward model trained only on written-out wrong answers learns to reject those; GRPO then finds
the ones it never saw, and the policy's own mistakes are what it must tell apart from the right
answer. So before ``rm.before_rl`` trains the reward model, the RL start policy samples
``rm.on_policy_samples`` responses to every training (and held-out) prompt with the run's own
rollout engine and sampling settings; the rule reward (``reward.fn``) grades them, and each
prompt gives one pair per distinct response graded below its best one (the best preferred). A
prompt whose responses all grade alike gives none.

The pairs land in ``<output_dir>/data/rm_on_policy_{train,val}.jsonl`` (rows of
``rlcli.data.preferences``); the sampler (its engine) is kept and later serves the RL rollouts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from rlcli.data import PromptItem, write_jsonl
from rlcli.rollout.base import awake
from rlcli.rollout.batch import Sample
from rlcli.rollout.sampling import Sampler, accuracy_of
from rlcli.train.inputs import RunInputs, barrier

_SAMPLING_STEP = -1  # the seed stream of these samples, apart from every RL step's


def preference_rows(samples: Sequence[Sample], texts: Sequence[str]) -> list[dict[str, Any]]:
    """Per prompt (``Sample.group``), its best-graded response preferred over each distinct
    response graded lower; ``texts[i]`` is sample ``i``'s decoded response."""
    by_prompt: dict[int, dict[str, tuple[float, Sample]]] = defaultdict(dict)
    for sample, text in zip(samples, texts, strict=True):
        by_prompt[sample.group].setdefault(text, (sample.score, sample))
    rows = []
    for group in sorted(by_prompt):
        responses = by_prompt[group]
        chosen, (best, sample) = max(responses.items(), key=lambda entry: entry[1][0])
        messages = sample.item.prompt_messages
        rows += [
            {"prompt": messages, "chosen": chosen, "rejected": text}
            for text, (score, _) in responses.items()
            if score < best
        ]
    return rows


def _graded_rows(
    sampler: Sampler, items: Sequence[PromptItem]
) -> tuple[list[dict[str, Any]], float]:
    """The rows of ``items`` and the samples' accuracy (``rlcli.rollout.sampling.accuracy_of``)."""
    sampling = sampler.sampling(_SAMPLING_STEP, train=True)
    with awake(sampler.engine):
        samples = sampler.generate(items, sampler.cfg.rm.on_policy_samples, sampling)
    # Every rank needs every text for the pairs; scoring reuses them instead of decoding again.
    texts = sampler.tokenizer.batch_decode(
        [s.response_ids for s in samples], skip_special_tokens=True
    )
    sampler.score(samples, texts=texts)
    return preference_rows(samples, texts), accuracy_of(samples)


def write_on_policy_pairs(
    inputs: RunInputs, sampler: Sampler, log: Callable[[str], None]
) -> tuple[list[str], list[str]]:
    """Sample, grade and write the pairs (collective: every rank calls it); returns the training
    and held-out pair files (no held-out file without held-out prompts)."""
    data_dir = inputs.output_dir / "data"
    splits = {"train": inputs.train_data, "val": inputs.val_data}
    files: dict[str, list[str]] = {"train": [], "val": []}
    for split, items in splits.items():
        if items is None or not len(items):
            continue
        rows, accuracy = _graded_rows(sampler, list(items))
        path = data_dir / f"rm_on_policy_{split}.jsonl"
        if inputs.mesh.rank == 0:
            write_jsonl(str(path), rows)
        log(
            f"on-policy pairs ({split}): {inputs.cfg.rm.on_policy_samples} samples of "
            f"{len(items)} prompts, {accuracy:.1%} graded right, {len(rows)} pairs -> {path}"
        )
        if rows:
            files[split].append(str(path))
    barrier()
    return files["train"], files["val"]
