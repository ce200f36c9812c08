"""Prompt rows with images (rlcli/data/images.py, rlcli/data/dataset.py): every way an image can be
given loads; a row's token ids, pixel values and image grids equal what the model's processor
(transformers' Qwen2.5-VL processor, built here from a local tokenizer) gives for the same
messages and images written by hand; bad rows are refused naming the row and the key."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import pytest
import torch

from rlcli.data import load_prompt_dataset
from rlcli.errors import UserError

pytest.importorskip("torchvision", reason="Qwen2.5-VL's processor needs torchvision's transforms")

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
# A ChatML template that writes an image part as Qwen2-VL's does (one placeholder token, which
# the processor expands to the image's merged patches).
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def processor():
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    from rlcli.model.builder import train_tokenizer

    tokenizer = train_tokenizer(["What is the sum of the digits?", "count the squares"], 300)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]}
    )
    tokenizer.chat_template = TEMPLATE  # text rows: the tokenizer renders them alone
    # 28 x 28 pixels = one merged 2 x 2 block of 14-pixel patches; images up to 56 x 56
    images = Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=56 * 56)
    return Qwen2_5_VLProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=TEMPLATE,
    )


def picture(size: tuple[int, int], colour: tuple[int, int, int]):
    from PIL import Image

    return Image.new("RGB", size, colour)


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def row(content, images) -> dict:
    return {
        "data_source": "digits",
        "prompt": [{"role": "user", "content": content}],
        "images": images,
        "reward_model": {"ground_truth": "3"},
    }


def write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_rows_equal_the_processor_on_hand_written_messages(tmp_path, processor):
    red, blue = picture((56, 28), (200, 10, 10)), picture((28, 28), (10, 10, 200))
    (tmp_path / "img").mkdir()
    red.save(tmp_path / "img" / "red.png")
    blue_b64 = base64.b64encode(png_bytes(blue)).decode()
    rows = [
        # a relative path, then a data URL; text around and between the placeholders
        row("<image>and<image>What is the sum of the digits?", ["img/red.png", f"data:image/png;base64,{blue_b64}"]),
        # verl's objects: base64 bytes, a path under "image"
        row("count the squares<image>", [{"bytes": blue_b64}]),
        row("<image>", [{"image": str(tmp_path / "img" / "red.png")}]),
    ]  # fmt: skip
    data = load_prompt_dataset(
        write(tmp_path / "train.jsonl", rows), processor.tokenizer, processor=processor
    )
    by_hand = [
        ([{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
          {"type": "text", "text": "What is the sum of the digits?"}], [red, blue]),
        ([{"type": "text", "text": "count the squares"}, {"type": "image"}], [blue]),
        ([{"type": "image"}], [red]),
    ]  # fmt: skip
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for item, (content, images) in zip(data, by_hand, strict=True):
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        want = processor(text=[text], images=images, return_tensors="pt")
        assert item.prompt_token_ids == want["input_ids"][0].tolist()
        assert torch.equal(item.image_inputs.pixel_values, want["pixel_values"].float())
        assert torch.equal(item.image_inputs.image_grid_thw, want["image_grid_thw"])
        assert len(item.images) == len(images) and item.prompt_text == text
        # each image's merged 2 x 2 patches are its placeholder tokens
        grids = item.image_inputs.image_grid_thw
        assert item.prompt_token_ids.count(image_pad) == int(grids.prod(dim=1).sum()) // 4
    assert data[0].image_inputs.image_grid_thw.tolist() == [[1, 2, 4], [1, 2, 2]]


def test_a_batch_of_rows_with_images_has_transformers_positions(tmp_path, processor):
    # The batch's multimodal positions (prompt from the processor, the response counting on)
    # against transformers' get_rope_index over each whole row; a text row beside them.
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    from rlcli.rollout.batch import Sample, collate

    blue = base64.b64encode(png_bytes(picture((56, 28), (0, 0, 255)))).decode()
    red = base64.b64encode(png_bytes(picture((28, 28), (255, 0, 0)))).decode()
    plain = {"data_source": "digits", "prompt": "count", "reward_model": {"ground_truth": "1"}}
    rows = [row("<image>and<image>sum?", [{"bytes": blue}, {"bytes": red}]), plain,
            row("count<image>", [{"bytes": red}])]  # fmt: skip
    data = load_prompt_dataset(write(tmp_path / "b.jsonl", rows), processor.tokenizer,
                               processor=processor)  # fmt: skip
    responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    batch = collate(
        [Sample(i, list(item.prompt_token_ids), response, [0.0] * len(response), "stop", item)
         for i, (item, response) in enumerate(zip(data, responses, strict=True))],
        pad_id=0,
    )  # fmt: skip
    tokenizer = processor.tokenizer
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "vocab_size": len(tokenizer)},
        vision_config={"depth": 1, "hidden_size": 16, "num_heads": 1, "out_hidden_size": 32},
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )  # fmt: skip
    model = Qwen2_5_VLModel(config)
    grids = torch.cat([item.image_inputs.image_grid_thw for item in data if item.images])
    want, _ = model.get_rope_index(
        batch.input_ids, (batch.input_ids == config.image_token_id).int(),
        image_grid_thw=grids, attention_mask=batch.attention_mask,
    )  # fmt: skip
    real = batch.attention_mask.bool()
    assert torch.equal(batch.position_ids.permute(2, 0, 1)[:, real], want[:, real])
    assert batch.image_grid_thw[1].abs().sum() == 0 and batch.pixel_values[1].abs().sum() == 0
    assert batch.image_grid_thw[0].tolist() == [[1, 2, 4], [1, 2, 2]]


def test_text_rows_beside_image_rows_keep_the_tokenizer_path(tmp_path, processor):
    plain = {
        "data_source": "digits",
        "prompt": "count the squares",
        "reward_model": {"ground_truth": "3"},
    }
    blue = base64.b64encode(png_bytes(picture((28, 28), (0, 0, 255)))).decode()
    data = load_prompt_dataset(
        write(tmp_path / "mixed.jsonl", [plain, row("<image>", [{"bytes": blue}])]),
        processor.tokenizer,
        processor=processor,
    )
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "count the squares"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert (
        data[0].prompt_token_ids == processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    )
    assert data[0].images == [] and data[0].image_inputs is None
    assert data[1].image_inputs is not None


@pytest.mark.parametrize(
    ("content", "images", "message"),
    [
        ("<image>", ["nowhere.png"], "train.jsonl, line 1: key images[0]: no image file"),
        ("<image>", ["notes.txt"], "key images[0]:"),
        ("<image>", [{"bytes": "%%%"}], "key images[0]: the bytes are not valid base64"),
        ("<image>", [{"caption": "x"}], "key images[0] holds none of 'bytes', 'path', 'image'"),
        ("<image>", "img.png", "key 'images' must be a list"),
        ("<image><image>", ["img.png"], "2 <image> placeholder(s) in 'prompt' but 1 image(s)"),
        ("no placeholder", ["img.png"], "0 <image> placeholder(s) in 'prompt' but 1 image(s)"),
    ],
)
def test_bad_image_rows_name_the_row_and_key(tmp_path, processor, content, images, message):
    picture((28, 28), (0, 0, 0)).save(tmp_path / "img.png")
    (tmp_path / "notes.txt").write_text("not an image")
    path = write(tmp_path / "train.jsonl", [row(content, images)])
    with pytest.raises(UserError, match=re.escape(message)):
        load_prompt_dataset(path, processor.tokenizer, processor=processor)


def test_a_text_only_model_refuses_rows_with_images(tmp_path, processor):
    path = write(tmp_path / "train.jsonl", [row("<image>", ["img.png"])])
    with pytest.raises(
        UserError, match="line 1: the row has images, but the model has no image processor"
    ):
        load_prompt_dataset(path, processor.tokenizer)


def test_rlcli_data_images_turns_a_folder_and_questions_into_rows(tmp_path, processor):
    from tests.rlcli.test_config import run_cli

    folder = tmp_path / "pictures"
    folder.mkdir()
    picture((28, 28), (255, 0, 0)).save(folder / "a.png")
    picture((56, 28), (0, 255, 0)).save(folder / "b.png")
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        json.dumps({"image": "a.png", "question": "What colour?", "answer": "red"})
        + "\n"
        + json.dumps({"images": ["a.png", "b.png"], "question": "How many?", "answer": 2})
        + "\n"
    )
    out = tmp_path / "rows" / "train.jsonl"
    args = ["data", "images", "--images", str(folder), "--questions", str(questions)]
    proc = run_cli(*args, "--output", str(out), "--data-source", "colours")
    assert proc.returncode == 0, proc.stderr
    data = load_prompt_dataset(str(out), processor.tokenizer, processor=processor)
    assert [len(item.images) for item in data] == [1, 2]
    assert [item.ground_truth for item in data] == ["red", "2"]
    assert data[1].prompt_messages[0]["content"] == "<image><image>How many?"
    assert data[0].data_source == "colours"

    questions.write_text(
        json.dumps({"image": "missing.png", "question": "?", "answer": "x"}) + "\n"
    )
    proc = run_cli(*args, "--output", str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "questions.jsonl, line 1: key images[0]: no image file" in proc.stderr
