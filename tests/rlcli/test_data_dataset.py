"""Prompt datasets: tokenization with and without a chat template, length filtering, and the
error messages for bad input (they must name the file, the row and the key)."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rlcli.data import load_prompt_dataset, write_jsonl
from rlcli.errors import UserError

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def raw_tokenizer() -> Tokenizer:
    """A byte-level BPE trained locally on a few strings (nothing is downloaded)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["Question: 1 + 2 = ? Answer: #### 3", "Natalia sold clips to 48 of her friends"]
    tokenizer.train_from_iterator(corpus * 10, trainer)
    return tokenizer


def _hf_tokenizer(raw: Tokenizer, chat_template: str | None) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    tokenizer.chat_template = chat_template
    return tokenizer


def _row(content: str = "Question: 1 + 2 = ? Answer:", ground_truth: str = "3", **extra) -> dict:
    row = {
        "data_source": "arith",
        "prompt": [{"role": "user", "content": content}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"index": 0},
    }
    row.update(extra)
    return row


def test_chat_template_applied_when_tokenizer_has_one(tmp_path, raw_tokenizer):
    path = str(tmp_path / "train.jsonl")
    write_jsonl(path, [_row("Natalia sold clips"), _row("Question: 4 + 5 = ? Answer:", "9")])
    dataset = load_prompt_dataset([path], _hf_tokenizer(raw_tokenizer, CHAT_TEMPLATE))

    assert dataset.uses_chat_template and len(dataset) == 2
    expected_text = "<|im_start|>user\nNatalia sold clips<|im_end|>\n<|im_start|>assistant\n"
    item = dataset[0]
    assert item.prompt_text == expected_text
    # Independent: the raw Rust tokenizer on the hand-written text, no special tokens added.
    assert (
        item.prompt_token_ids == raw_tokenizer.encode(expected_text, add_special_tokens=False).ids
    )
    assert item.prompt_token_ids[0] == raw_tokenizer.token_to_id("<|im_start|>")
    assert (item.data_source, item.ground_truth, item.index) == ("arith", "3", 0)
    assert dataset[1].ground_truth == "9" and dataset[1].index == 1
    assert dataset[1].origin == f"{path}, line 2"


def test_without_chat_template_prompt_is_joined_contents(tmp_path, raw_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Question: 1 + 2 = ? Answer:"},
    ]
    path = str(tmp_path / "train.jsonl")
    write_jsonl(path, [_row(prompt=messages)])
    dataset = load_prompt_dataset(path, _hf_tokenizer(raw_tokenizer, None))

    expected_text = "Be brief.\nQuestion: 1 + 2 = ? Answer:"
    assert not dataset.uses_chat_template
    assert dataset[0].prompt_text == expected_text
    assert dataset[0].prompt_token_ids == raw_tokenizer.encode(expected_text).ids


def test_apply_chat_template_true_without_template_is_a_user_error(tmp_path, raw_tokenizer):
    path = str(tmp_path / "train.jsonl")
    write_jsonl(path, [_row()])
    with pytest.raises(UserError, match="no chat_template"):
        load_prompt_dataset(path, _hf_tokenizer(raw_tokenizer, None), apply_chat_template=True)


def test_max_prompt_length_drops_and_counts_long_prompts(tmp_path, raw_tokenizer, caplog):
    tokenizer = _hf_tokenizer(raw_tokenizer, None)
    short, long = "Question: 1 + 2 = ? Answer:", "Natalia sold clips to 48 of her friends " * 5
    limit = len(raw_tokenizer.encode(short).ids)
    assert len(raw_tokenizer.encode(long).ids) > limit
    path = str(tmp_path / "train.jsonl")
    write_jsonl(path, [_row(short), _row(long), _row(short), _row(long), _row(long)])

    with caplog.at_level(logging.WARNING, logger="rlcli.data.dataset"):
        dataset = load_prompt_dataset(path, tokenizer, max_prompt_length=limit)
    assert len(dataset) == 2 and dataset.num_dropped_too_long == 3
    assert [item.index for item in dataset] == [0, 1]
    assert [item.origin for item in dataset] == [f"{path}, line 1", f"{path}, line 3"]
    assert "dropped 3 of 5 prompts" in caplog.text

    with pytest.raises(UserError, match="all 5 prompts .* max_prompt_length=1 "):
        load_prompt_dataset(path, tokenizer, max_prompt_length=1)


def test_parquet_rows_load_like_jsonl(tmp_path, raw_tokenizer):
    rows = [_row("Question: 1 + 2 = ? Answer:", "3"), _row("Natalia sold clips", "72")]
    jsonl_path, parquet_path = str(tmp_path / "a.jsonl"), str(tmp_path / "a.parquet")
    write_jsonl(jsonl_path, rows)
    pq.write_table(pa.Table.from_pylist(rows), parquet_path)
    tokenizer = _hf_tokenizer(raw_tokenizer, CHAT_TEMPLATE)

    from_jsonl = load_prompt_dataset(jsonl_path, tokenizer)
    from_parquet = load_prompt_dataset(parquet_path, tokenizer)
    assert [i.prompt_token_ids for i in from_parquet] == [i.prompt_token_ids for i in from_jsonl]
    assert [i.ground_truth for i in from_parquet] == ["3", "72"]
    assert from_parquet[1].origin == f"{parquet_path}, row 1"
    both = load_prompt_dataset([jsonl_path, parquet_path], tokenizer)
    assert len(both) == 4 and both.files == [jsonl_path, parquet_path]


def _load_error(tmp_path, raw_tokenizer, lines: list[str], name: str = "bad.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(UserError) as error:
        load_prompt_dataset(str(path), _hf_tokenizer(raw_tokenizer, None))
    return str(error.value)


def test_row_without_prompt_names_file_line_and_key(tmp_path, raw_tokenizer):
    bad = _row()
    del bad["prompt"]
    message = _load_error(tmp_path, raw_tokenizer, [json.dumps(_row()), "", json.dumps(bad)])
    assert f"{tmp_path / 'bad.jsonl'}, line 3" in message and "'prompt'" in message


def test_custom_prompt_key_is_named(tmp_path, raw_tokenizer):
    path = str(tmp_path / "train.jsonl")
    write_jsonl(path, [_row()])
    with pytest.raises(UserError, match=r"train.jsonl, line 1: missing key 'question'"):
        load_prompt_dataset(path, _hf_tokenizer(raw_tokenizer, None), prompt_key="question")


def test_missing_ground_truth_names_file_line_and_key(tmp_path, raw_tokenizer):
    bad = _row()
    bad["reward_model"] = {"style": "rule"}
    message = _load_error(tmp_path, raw_tokenizer, [json.dumps(_row()), json.dumps(bad)])
    assert "bad.jsonl, line 2" in message and "reward_model.ground_truth" in message


def test_missing_ground_truth_in_parquet_names_row_index(tmp_path, raw_tokenizer):
    rows = [_row(), _row(), _row()]
    rows[2]["reward_model"] = {"style": "rule", "ground_truth": None}
    path = str(tmp_path / "bad.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(UserError) as error:
        load_prompt_dataset(path, _hf_tokenizer(raw_tokenizer, None))
    assert f"{path}, row 2" in str(error.value)
    assert "reward_model.ground_truth" in str(error.value)


def test_invalid_json_line_names_file_and_line(tmp_path, raw_tokenizer):
    message = _load_error(tmp_path, raw_tokenizer, [json.dumps(_row()), '{"prompt": [oops'])
    assert "bad.jsonl, line 2" in message and "invalid JSON" in message


def test_malformed_message_names_the_key(tmp_path, raw_tokenizer):
    message = _load_error(tmp_path, raw_tokenizer, [json.dumps(_row(prompt=[{"role": "user"}]))])
    assert "line 1" in message and "prompt[0]" in message and "'content'" in message


def test_empty_dataset_is_a_user_error(tmp_path, raw_tokenizer):
    message = _load_error(tmp_path, raw_tokenizer, ["", "  "])
    assert "bad.jsonl" in message and "empty" in message


def test_missing_file_and_unsupported_extension(tmp_path, raw_tokenizer):
    tokenizer = _hf_tokenizer(raw_tokenizer, None)
    with pytest.raises(UserError, match="data file not found: .*nope.jsonl"):
        load_prompt_dataset(str(tmp_path / "nope.jsonl"), tokenizer)
    csv_path = tmp_path / "train.csv"
    csv_path.write_text("prompt\nhi\n")
    with pytest.raises(UserError, match=r"unsupported .*'\.csv'.*train\.csv.*\.jsonl, \.parquet"):
        load_prompt_dataset(str(csv_path), tokenizer)


def test_bos_added_without_template_but_not_on_top_of_one(tmp_path, raw_tokenizer):
    """A Llama-style tokenizer adds BOS to plain text; a chat template writes its own tokens."""
    from tokenizers import processors

    with_bos = Tokenizer.from_str(raw_tokenizer.to_str())
    bos_id = with_bos.token_to_id("<|endoftext|>")
    with_bos.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos_id)]
    )
    path = str(tmp_path / "train.jsonl")
    write_jsonl(path, [_row("Natalia sold clips")])

    plain = load_prompt_dataset(path, _hf_tokenizer(with_bos, None))[0]
    assert plain.prompt_token_ids == [bos_id] + raw_tokenizer.encode("Natalia sold clips").ids
    templated = load_prompt_dataset(path, _hf_tokenizer(with_bos, CHAT_TEMPLATE))[0]
    assert templated.prompt_token_ids == raw_tokenizer.encode(templated.prompt_text).ids
    assert bos_id not in templated.prompt_token_ids
