"""Task data: the GSM8K converter and the synthetic addition (quickstart) task."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcli.data import arith_split, convert_gsm8k, read_rows, read_sft_pairs, write_arith_dataset
from rlcli.data.gsm8k import INSTRUCTION
from rlcli.errors import UserError
from rlcli.rewards import default_compute_score

# Two real GSM8K train rows, plus a made-up one with a thousands separator and one negative.
RAW_GSM8K = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
        "many clips in May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes "
        "of babysitting. How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
        "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
    },
    {"question": "A farm has 1,000 hens and buys 250 more.", "answer": "1000+250=1250\n#### 1,250"},
    {"question": "It is 3 degrees and falls by 5.", "answer": "3-5=-2\n#### -2"},
]


def _write_raw(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_convert_gsm8k_writes_verl_rows(tmp_path):
    raw = tmp_path / "train.jsonl"
    _write_raw(raw, RAW_GSM8K)
    counts = convert_gsm8k(str(raw), str(tmp_path / "out"))
    assert counts == {"train": 4}

    rows = [row for _, row in read_rows(str(tmp_path / "out" / "train.jsonl"))]
    assert [row["reward_model"]["ground_truth"] for row in rows] == ["72", "10", "1250", "-2"]
    first = rows[0]
    assert first["data_source"] == "openai/gsm8k" and first["ability"] == "math"
    assert first["prompt"] == [
        {"role": "user", "content": RAW_GSM8K[0]["question"] + " " + INSTRUCTION}
    ]
    assert first["reward_model"]["style"] == "rule"
    assert first["extra_info"] == {
        "split": "train",
        "index": 0,
        "question": RAW_GSM8K[0]["question"],
        "answer": RAW_GSM8K[0]["answer"],
    }
    # The reference solutions themselves earn full reward under the default reward.
    for row, raw_row in zip(rows, RAW_GSM8K, strict=True):
        result = default_compute_score(
            row["data_source"], raw_row["answer"], row["reward_model"]["ground_truth"]
        )
        assert result["score"] == 1.0


def test_convert_gsm8k_folder_with_jsonl_and_parquet(tmp_path):
    raw_dir = tmp_path / "raw"
    raw_dir.mkdir()
    _write_raw(raw_dir / "train.jsonl", RAW_GSM8K[:3])
    pq.write_table(pa.Table.from_pylist(RAW_GSM8K[3:]), raw_dir / "test-00000-of-00001.parquet")
    counts = convert_gsm8k(str(raw_dir), str(tmp_path / "out"))
    assert counts == {"test": 1, "train": 3}
    test_rows = [row for _, row in read_rows(str(tmp_path / "out" / "test.jsonl"))]
    assert test_rows[0]["reward_model"]["ground_truth"] == "-2"
    assert test_rows[0]["extra_info"]["split"] == "test"


def test_convert_gsm8k_bad_rows_name_line_and_key(tmp_path):
    raw = tmp_path / "train.jsonl"
    _write_raw(raw, [RAW_GSM8K[0], {"question": "no answer key"}])
    with pytest.raises(UserError, match=r"train.jsonl, line 2: missing key 'answer'"):
        convert_gsm8k(str(raw), str(tmp_path / "out"))
    _write_raw(raw, [{"question": "q", "answer": "no final line"}])
    with pytest.raises(UserError, match=r"line 1: key 'answer' has no final '#### <number>'"):
        convert_gsm8k(str(raw), str(tmp_path / "out"))
    with pytest.raises(UserError, match="data file not found"):
        convert_gsm8k(str(tmp_path / "missing.jsonl"), str(tmp_path / "out"))


def test_arith_split_is_deterministic_disjoint_and_complete():
    train, val = arith_split(num_max=10, num_val=20, seed=0)
    assert len(train) == 80 and len(val) == 20
    pairs = {(e.a, e.b) for e in train} | {(e.a, e.b) for e in val}
    assert pairs == {(a, b) for a in range(10) for b in range(10)}
    assert arith_split(10, 20, seed=0) == (train, val)
    assert arith_split(10, 20, seed=1)[1] != val
    with pytest.raises(UserError, match="num_val"):
        arith_split(num_max=3, num_val=9)


def test_write_arith_dataset_rows_and_sft_pairs(tmp_path):
    paths = write_arith_dataset(str(tmp_path), num_max=50, num_val=200, seed=0)
    assert set(paths) == {"train", "val", "sft_train", "sft_val"}
    val_rows = [row for _, row in read_rows(paths["val"])]
    train_rows = [row for _, row in read_rows(paths["train"])]
    assert len(val_rows) == 200 and len(train_rows) == 2300

    for row in val_rows[:20]:
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        assert row["data_source"] == "arith"
        assert row["prompt"] == [{"role": "user", "content": f"Question: {a} + {b} = ? Answer:"}]
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(a + b)}

    sft_val = read_sft_pairs(paths["sft_val"])
    assert len(sft_val) == 200
    for (prompt, response), row in zip(sft_val, val_rows, strict=True):
        assert prompt == row["prompt"][0]["content"]
        assert response == f" #### {row['reward_model']['ground_truth']}"
        # The SFT target is exactly what the arith reward accepts.
        assert default_compute_score("arith", response, row["reward_model"]["ground_truth"]) == {
            "score": 1.0,
            "acc": 1.0,
        }
