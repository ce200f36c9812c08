"""Qwen3.5's multimodal checkpoint -> its language model as a text folder
(`rlcli convert language-model`, parallel/convert/language_model.py), checked against
transformers: the multimodal model's text-only logits equal the extracted text model's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from parallel.convert import hf_model_dir_problem
from parallel.convert.language_model import extract_language_model
from rlcli.commands.plan_inputs import shape_of_config
from tests.parallel.dist_utils import FAMILY_CONFIG, REPO_ROOT, TINY_CONFIG

MULTIMODAL = {  # family: (config class, multimodal model class, its text model's type)
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "qwen3_5_text"),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text"),
}


def make_multimodal(out, family: str, seed: int = 0):
    import transformers

    config_name, model_name, _ = MULTIMODAL[family]
    text = {**TINY_CONFIG, **FAMILY_CONFIG[family]}
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": text.pop("rope_theta"),
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],  # 2 * sum = the rotated quarter of head_dim 32
    }
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = getattr(transformers, config_name)(text_config=text, vision_config=vision)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():  # HF starts norms at 1 (stored 0) and dt_bias at 1: a mix-up would hide
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                param.normal_(std=0.3)
    model.save_pretrained(out)
    return model


@pytest.mark.parametrize("family", sorted(MULTIMODAL))
def test_the_extracted_language_model_gives_the_multimodal_models_text_logits(family, tmp_path):
    from transformers import AutoModelForCausalLM

    source, text_dir = tmp_path / "multimodal", tmp_path / "text"
    multimodal = make_multimodal(source, family)
    problem = hf_model_dir_problem(source)
    assert problem and "rlcli convert language-model" in problem, problem

    extracted = extract_language_model(source, text_dir)
    visual = sum(1 for name in multimodal.state_dict() if name.startswith("model.visual."))
    assert extracted.left_behind == {"model.visual": visual}
    assert extracted.model_type == MULTIMODAL[family][2]
    assert hf_model_dir_problem(text_dir) is None
    # `rlcli plan` sizes what is trained of it: the language model
    assert shape_of_config(source / "config.json") == shape_of_config(text_dir / "config.json")

    text_model = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    assert type(text_model).__name__ == extracted.architecture
    ids = torch.tensor([[5, 17, 200, 3, 99, 42, 8, 250, 1, 64]])
    with torch.no_grad():
        want = multimodal(input_ids=ids).logits
        got = text_model(input_ids=ids).logits
    assert (got - want).abs().max().item() < 1e-5


def rlcli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlcli.cli", *args], cwd=REPO_ROOT, capture_output=True,
        text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def test_the_command_extracts_verifies_and_refuses_what_it_cannot_take(tmp_path):
    source, text_dir = tmp_path / "multimodal", tmp_path / "text"
    make_multimodal(source, "qwen3_5", seed=1)
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))

    proc = rlcli("convert", "language-model", "--model", str(source), "--out", str(text_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "left behind: model.visual.*" in proc.stdout, proc.stdout
    assert (text_dir / "generation_config.json").is_file()
    # Megatron against transformers on what came out (fp32 logits, the verify command's bound)
    proc = rlcli("convert", "verify", "--model", str(text_dir))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    for args, says in (
        (["--model", str(text_dir), "--out", str(tmp_path / "again")], "needs no extraction"),
        (["--model", str(source), "--out", str(text_dir)], "is not empty"),
    ):
        proc = rlcli("convert", "language-model", *args)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
