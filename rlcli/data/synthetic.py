"""The quickstart task: ``"Question: A + B = ? Answer:"`` -> ``" #### <A+B>"``.

All ordered pairs (A, B) with A, B in ``0 .. num_max-1`` are shuffled with ``seed``; the first
``num_val`` are held out. The same split is written as RL prompt rows in the verl schema
(``data_source: "arith"``, scored by the ``arith`` reward) and as supervised pairs
``{"prompt": ..., "response": ...}`` for the warm start, and as preference pairs for a reward
model (``write_arith_preferences``: the correct answer preferred). The tokenizer of the
quickstart has no chat template, so the prompt text the model sees is exactly
``Question: A + B = ? Answer:``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from rlcli.data.rows import read_rows, write_jsonl
from rlcli.errors import UserError

DATA_SOURCE = "arith"


@dataclass(frozen=True)
class ArithExample:
    """One addition problem."""

    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def prompt_text(self) -> str:
        return f"Question: {self.a} + {self.b} = ? Answer:"

    @property
    def response_text(self) -> str:
        """The target completion (the trainer appends EOS)."""
        return f" #### {self.answer}"


def arith_split(
    num_max: int = 50, num_val: int = 200, seed: int = 0
) -> tuple[list[ArithExample], list[ArithExample]]:
    """Deterministic (train, held-out) split of all ``num_max**2`` ordered pairs."""
    total = num_max * num_max
    if num_max < 1 or not 0 <= num_val < total:
        raise UserError(
            f"arith task needs num_max >= 1 and 0 <= num_val < num_max**2 = {total}, "
            f"got num_max={num_max}, num_val={num_val}"
        )
    order = np.random.default_rng(seed).permutation(total)
    examples = [ArithExample(int(i) // num_max, int(i) % num_max) for i in order]
    return examples[num_val:], examples[:num_val]


def arith_row(example: ArithExample, split: str, index: int) -> dict:
    """The prompt row for one example, in the verl schema."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": example.prompt_text}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(example.answer)},
        "extra_info": {"split": split, "index": index, "a": example.a, "b": example.b},
    }


def write_arith_dataset(
    out_dir: str, num_max: int = 50, num_val: int = 200, seed: int = 0
) -> dict[str, str]:
    """Write ``train.jsonl`` / ``val.jsonl`` (prompt rows) and ``sft_train.jsonl`` /
    ``sft_val.jsonl`` (``{"prompt", "response"}`` pairs) into ``out_dir``; return their paths
    keyed ``train``, ``val``, ``sft_train``, ``sft_val``."""
    splits = dict(zip(("train", "val"), arith_split(num_max, num_val, seed), strict=True))
    paths: dict[str, str] = {}
    for split, examples in splits.items():
        paths[split] = os.path.join(out_dir, f"{split}.jsonl")
        write_jsonl(paths[split], (arith_row(e, split, i) for i, e in enumerate(examples)))
        paths[f"sft_{split}"] = os.path.join(out_dir, f"sft_{split}.jsonl")
        write_jsonl(
            paths[f"sft_{split}"],
            ({"prompt": e.prompt_text, "response": e.response_text} for e in examples),
        )
    return paths


def read_sft_pairs(path: str) -> list[tuple[str, str]]:
    """Read ``{"prompt": str, "response": str}`` rows as ``(prompt_text, response_text)``."""
    pairs = []
    for location, row in read_rows(path):
        for key in ("prompt", "response"):
            if not isinstance(row.get(key), str):
                raise UserError(f"{location}: missing string key {key!r} in an SFT pair row")
        pairs.append((row["prompt"], row["response"]))
    if not pairs:
        raise UserError(f"{path} has no SFT pairs")
    return pairs


def _wrong_response(example: ArithExample, rng: np.random.Generator, num_max: int) -> str:
    """A dispreferred answer: 40% a near miss (the sum off by 1..10, as a policy that almost knows
    the sum errs), 40% any other number a sum can be (the answers a drifting policy reaches: a
    reward model that never saw them rates some of them above the right one), else a malformed
    answer (no ``####``, or no number)."""
    kind = rng.random()
    if kind < 0.4:
        offsets = [d for d in range(-10, 11) if d and example.answer + d >= 0]
        return f" #### {example.answer + int(rng.choice(offsets))}"
    if kind < 0.8:
        others = [n for n in range(2 * num_max + 1) if n != example.answer]
        return f" #### {int(rng.choice(others))}"
    if rng.random() < 0.5:
        return f" {example.answer}"
    return " #### "


def arith_preference_rows(
    example: ArithExample, rng: np.random.Generator, num_max: int, count: int
) -> list[dict]:
    """``count`` preference rows for one prompt: the correct answer preferred over a wrong one."""
    prompt = [{"role": "user", "content": example.prompt_text}]
    return [
        {"prompt": prompt, "chosen": example.response_text,
         "rejected": _wrong_response(example, rng, num_max)}
        for _ in range(count)
    ]  # fmt: skip


def write_arith_preferences(
    out_dir: str, num_max: int = 50, num_val: int = 200, seed: int = 0, per_prompt: int = 4
) -> dict[str, str]:
    """Write ``rm_train.jsonl`` (``per_prompt`` preference rows for each training prompt) and
    ``rm_val.jsonl`` (one for each held-out prompt), on the same train / held-out split as
    ``write_arith_dataset``, into ``out_dir``; return their paths keyed ``rm_train``,
    ``rm_val``."""
    rng = np.random.default_rng(seed)
    splits = dict(zip(("train", "val"), arith_split(num_max, num_val, seed), strict=True))
    paths: dict[str, str] = {}
    for split, examples in splits.items():
        count = per_prompt if split == "train" else 1
        paths[f"rm_{split}"] = os.path.join(out_dir, f"rm_{split}.jsonl")
        write_jsonl(
            paths[f"rm_{split}"],
            [row for e in examples for row in arith_preference_rows(e, rng, num_max, count)],
        )
    return paths
