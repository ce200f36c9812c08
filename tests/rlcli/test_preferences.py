"""Preference rows for reward models: reading (JSONL, Parquet, text or chat prompts, string or
conversational responses), tokenising with the reward model's tokenizer and chat template, the
errors for bad rows (file + row + key), and the quickstart's synthetic pairs."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcli.data import arith_split, read_rows, write_arith_dataset, write_arith_preferences
from rlcli.data.chat import encode_prompt_and_response
from rlcli.data.preferences import read_preference_rows, tokenize_preferences
from rlcli.data.rows import write_jsonl
from rlcli.errors import UserError
from tests.rlcli.chat_tokenizers import CHAT_TEMPLATE, make_tokenizer

ROWS = [
    {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "chosen": "5", "rejected": "6"},
    {
        "prompt": "What is 1 + 2?",
        "chosen": [{"role": "assistant", "content": "It is 3."}],
        "rejected": [{"role": "assistant", "content": "It is 4."}],
    },
]


def test_rows_from_jsonl_and_parquet_agree(tmp_path):
    jsonl, parquet = tmp_path / "p.jsonl", tmp_path / "p.parquet"
    write_jsonl(str(jsonl), ROWS[:1])
    pq.write_table(pa.Table.from_pylist(ROWS[:1]), parquet)
    from_jsonl = read_preference_rows([str(jsonl)])
    from_parquet = read_preference_rows([str(parquet)])
    assert [(r.prompt, r.chosen, r.rejected) for r in from_jsonl] == [
        (r.prompt, r.chosen, r.rejected) for r in from_parquet
    ]
    assert from_jsonl[0].origin == f"{jsonl}, line 1" and from_parquet[0].origin.endswith("row 0")


def test_tokenised_with_the_chat_template(tmp_path):
    path = tmp_path / "p.jsonl"
    write_jsonl(str(path), ROWS)
    tokenizer = make_tokenizer(CHAT_TEMPLATE)
    pairs, dropped = tokenize_preferences(read_preference_rows([str(path)]), tokenizer)
    assert dropped == 0 and pairs.margins is None
    expected = tokenizer(
        "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\nIt is 4.<|im_end|>\n",
        add_special_tokens=False,
    )["input_ids"]
    assert pairs.rejected[1] == expected
    # an unfinished response keeps the generation prompt and is not closed
    open_ended = encode_prompt_and_response(
        tokenizer, ROWS[0]["prompt"], "5", use_template=True, finished=False
    )
    text = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n5"
    assert open_ended == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_tokenised_without_a_template_ends_with_eos(tmp_path):
    path = tmp_path / "p.jsonl"
    write_jsonl(str(path), [{**row, "margin": 0.5} for row in ROWS])
    tokenizer = make_tokenizer()
    pairs, _ = tokenize_preferences(read_preference_rows([str(path)]), tokenizer)
    prompt = tokenizer("What is 2 + 3?")["input_ids"]
    response = tokenizer("5", add_special_tokens=False)["input_ids"]
    assert pairs.chosen[0] == prompt + response + [tokenizer.eos_token_id]
    assert pairs.margins == [0.5, 0.5]
    short, dropped = tokenize_preferences(
        read_preference_rows([str(path)]), tokenizer, max_length=len(pairs.chosen[0])
    )
    assert dropped == 1 and len(short) == 1  # the second pair's sequences are longer


@pytest.mark.parametrize(
    ("row", "needles"),
    [
        ({"prompt": "q", "rejected": "b"}, ["line 2", "'chosen'", "missing", "keys present"]),
        ({"prompt": "q", "chosen": "a"}, ["line 2", "'rejected'", "missing"]),
        ({"prompt": "q", "chosen": 3, "rejected": "b"}, ["line 2", "'chosen'", "got 3"]),
        ({"chosen": "a", "rejected": "b"}, ["line 2", "missing key 'prompt'"]),
        ({"prompt": "q", "chosen": "a", "rejected": "b", "margin": "x"}, ["'margin'"]),
        ({"prompt": "q", "chosen": "a", "rejected": "b", "margin": 1}, ["some rows", "margin"]),
    ],
)
def test_bad_rows_name_file_row_and_key(tmp_path, row, needles):
    path = tmp_path / "bad.jsonl"
    write_jsonl(str(path), [ROWS[0], row])
    with pytest.raises(UserError) as caught:
        read_preference_rows([str(path)])
    for needle in needles:
        assert needle in str(caught.value), (needle, str(caught.value))
    assert str(path) in str(caught.value) or "some rows" in str(caught.value)


def test_no_files_or_rows_name_the_key(tmp_path):
    with pytest.raises(UserError, match="rm.val_files is empty"):
        read_preference_rows([], "rm.val_files")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(UserError, match="no preference rows"):
        read_preference_rows([str(tmp_path / "empty.jsonl")])


def test_synthetic_pairs_prefer_the_correct_answer_on_the_same_split(tmp_path):
    paths = write_arith_preferences(str(tmp_path), num_max=10, num_val=20, seed=3, per_prompt=4)
    prompts = write_arith_dataset(str(tmp_path / "prompts"), num_max=10, num_val=20, seed=3)
    train, held_out = arith_split(10, 20, 3)
    rows = [row for _, row in read_rows(paths["rm_val"])]
    assert len(rows) == 20  # one a held-out prompt
    train_rows = [row for _, row in read_rows(paths["rm_train"])]
    assert len(train_rows) == 4 * len(train)
    assert [r["prompt"][0]["content"] for r in train_rows[:4]] == [train[0].prompt_text] * 4
    val_prompts = [row["prompt"][0]["content"] for _, row in read_rows(prompts["val"])]
    kinds = set()
    for row, example in zip(rows, held_out, strict=True):
        assert row["prompt"][0]["content"] == example.prompt_text
        assert row["chosen"] == f" #### {example.answer}"
    for row in rows + train_rows:
        assert row["rejected"] != row["chosen"]
        answer = int(row["chosen"].removeprefix(" #### "))
        number = row["rejected"].removeprefix(" #### ")
        if not row["rejected"].startswith(" #### ") or not number:
            kinds.add("malformed")
        else:
            off = abs(int(number) - answer)
            assert 0 < off and (off <= 10 or int(number) <= 20)  # a near miss, or a sum's range
            kinds.add("near miss" if off <= 10 else "other number")
    assert kinds == {"near miss", "other number", "malformed"}
    assert [row["prompt"][0]["content"] for row in rows] == val_prompts
