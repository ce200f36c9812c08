"""The vision-language quickstart's task (``data.synthetic: count_squares``): how many squares?

Each picture is 56 x 56 pixels, a 2 x 2 grid of 28-pixel cells (one merged patch block of
Qwen2.5-VL's processor each, so the model reads it as four image tokens); one to four cells hold
a square of a random colour, size and offset on a grey background. The question is always the
same, so only the picture tells the answer: ``<image>How many squares?`` -> `` #### N``, scored
like the addition task (``rlcli.rewards.arith``: the response must start with the answer).

Written at run time with PIL under ``<output_dir>/data``: ``images/*.png``, the prompt rows
``train.jsonl`` / ``val.jsonl`` (verl's multimodal schema, ``rlcli.data.images``) and
``sft_train.jsonl`` (the same rows with their ``response``, for the supervised warm start).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from rlcli.data.rows import write_jsonl

DATA_SOURCE = "count_squares"
QUESTION = "<image>How many squares?"
CELL, CELLS = 28, 2  # pixels a cell side, cells a picture side
BACKGROUND = (128, 128, 128)


def draw_squares(count: int, rng: random.Random):
    """A picture with ``count`` squares in distinct cells."""
    from PIL import Image

    picture = Image.new("RGB", (CELL * CELLS, CELL * CELLS), BACKGROUND)
    for cell in rng.sample(range(CELLS * CELLS), count):
        side = rng.randint(12, 22)
        left = (cell % CELLS) * CELL + rng.randint(0, CELL - side)
        top = (cell // CELLS) * CELL + rng.randint(0, CELL - side)
        colour = tuple(rng.choice((rng.randint(0, 60), rng.randint(190, 255))) for _ in range(3))
        if colour == BACKGROUND:
            colour = (255, 255, 255)
        picture.paste(colour, (left, top, left + side, top + side))
    return picture


def count_squares_row(image: str, count: int, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": QUESTION}],
        "images": [image],
        "reward_model": {"style": "rule", "ground_truth": str(count)},
        "extra_info": {"split": split, "index": index},
    }


def write_count_squares_dataset(
    out_dir: str, num_train: int = 512, num_val: int = 128, seed: int = 0
) -> dict[str, str]:
    """Write the pictures and ``train.jsonl`` / ``val.jsonl`` / ``sft_train.jsonl`` into
    ``out_dir`` (module docstring); return the files' paths keyed ``train``, ``val``,
    ``sft_train``. The same ``seed`` writes the same pictures."""
    rng = random.Random(seed)
    folder = Path(out_dir)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {"train": [], "val": []}
    for split, size in (("train", num_train), ("val", num_val)):
        for index in range(size):
            count = rng.randint(1, CELLS * CELLS)
            name = f"images/{split}_{index:05d}.png"
            draw_squares(count, rng).save(folder / name)
            rows[split].append(count_squares_row(name, count, split, index))
    paths = {split: os.path.join(out_dir, f"{split}.jsonl") for split in rows}
    for split, split_rows in rows.items():
        write_jsonl(paths[split], split_rows)
    paths["sft_train"] = os.path.join(out_dir, "sft_train.jsonl")
    write_jsonl(
        paths["sft_train"],
        (
            {**row, "response": f" #### {row['reward_model']['ground_truth']}"}
            for row in rows["train"]
        ),
    )
    return paths
