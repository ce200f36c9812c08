"""`rlcli train` on bad input: exit code 2 and a message naming the file, row or key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlcli.config.model import ModelBuildConfig
from rlcli.data import arith_split
from rlcli.model.builder import build_model_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    train, _ = arith_split(num_max=10, num_val=10)
    spec = ModelBuildConfig(
        hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=128
    )
    out = tmp_path_factory.mktemp("model") / "tiny"
    return build_model_dir(spec, out, [e.prompt_text + e.response_text for e in train], seed=0)


def train(tmp_path: Path, model: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = [
        sys.executable,
        "-m",
        "rlcli.cli",
        "train",
        str(REPO / "recipes" / "quickstart.yaml"),
        "data.synthetic=null",
        "model.build=false",
        f"model.path={model}",
        "sft.steps=0",
        "data.train_batch_size=4",  # the tests' datasets hold 8 prompts
        "actor.micro_batch_size=32",
        f"trainer.output_dir={tmp_path / 'run'}",
        "rollout.engine=hf",
        *overrides,
    ]
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def good_row(i: int) -> dict:
    return {
        "data_source": "arith",
        "prompt": [{"role": "user", "content": f"Question: {i} + 1 = ? Answer:"}],
        "reward_model": {"ground_truth": str(i + 1)},
    }


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr[-3000:])


def _with_config(tmp_path: Path, model: Path, **changes) -> Path:
    """A copy of `model` whose config.json has `changes`."""
    import shutil

    out = tmp_path / "changed_model"
    shutil.copytree(model, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


@pytest.mark.parametrize(
    ("config_changes", "overrides", "needles"),
    [
        ({}, ["model.attention_backend=te"], ["model.attention_backend=te", "not installed"]),
        (
            {},
            ["actor.pack_sequences=true", "model.attention_backend=local"],
            ["actor.pack_sequences=true", "model.attention_backend=sdpa"],
        ),
        (
            {
                "use_sliding_window": True,
                "sliding_window": 16,
                "layer_types": ["sliding_attention"],
            },
            ["actor.pack_sequences=true"],
            ["pack_sequences=true", "sliding_window=16", "set pack_sequences=false"],
        ),
        (
            {"attention_dropout": 0.1},
            ["model.attention_backend=sdpa"],
            ["model.attention_backend=sdpa does not implement", "attention_dropout"],
        ),
    ],
)
def test_model_settings_this_machine_or_model_cannot_serve(
    tmp_path, model_dir, config_changes, overrides, needles
):
    from parallel.model_backends import transformer_engine_status

    if "model.attention_backend=te" in overrides and transformer_engine_status()[0]:
        pytest.skip("Transformer Engine is installed")
    model = _with_config(tmp_path, model_dir, **config_changes) if config_changes else model_dir
    rows = write_rows(tmp_path / "train.jsonl", [good_row(i) for i in range(8)])
    proc = train(tmp_path, model, f"data.train_files=[{rows}]", *overrides)
    assert_user_error(proc, *needles)


def test_reward_function_that_does_not_import(tmp_path, model_dir):
    rows = write_rows(tmp_path / "train.jsonl", [good_row(i) for i in range(8)])
    proc = train(
        tmp_path, model_dir, f"data.train_files=[{rows}]", "reward.fn=no_such_module:score"
    )
    assert_user_error(proc, "no_such_module:score")


def test_row_without_prompt(tmp_path, model_dir):
    rows = [good_row(i) for i in range(8)]
    del rows[2]["prompt"]
    path = write_rows(tmp_path / "train.jsonl", rows)
    proc = train(tmp_path, model_dir, f"data.train_files=[{path}]")
    assert_user_error(proc, str(path), "line 3", "prompt")


def test_missing_ground_truth(tmp_path, model_dir):
    rows = [good_row(i) for i in range(8)]
    rows[4]["reward_model"] = {}
    path = write_rows(tmp_path / "train.jsonl", rows)
    proc = train(tmp_path, model_dir, f"data.train_files=[{path}]")
    assert_user_error(proc, str(path), "line 5", "ground_truth")


def test_empty_dataset(tmp_path, model_dir):
    path = write_rows(tmp_path / "train.jsonl", [])
    proc = train(tmp_path, model_dir, f"data.train_files=[{path}]")
    assert_user_error(proc, str(path))


def test_model_path_that_is_not_a_model(tmp_path):
    rows = write_rows(tmp_path / "train.jsonl", [good_row(i) for i in range(8)])
    proc = train(tmp_path, tmp_path / "nowhere", f"data.train_files=[{rows}]")
    assert_user_error(proc, "model.path", "nowhere")


def write_latin1_rows(path: Path) -> Path:
    rows = [json.dumps(good_row(i)) for i in range(8)]
    rows[5] = rows[5].replace("Question:", "Qu\u00e9stion:")
    path.write_bytes("\n".join(rows).encode("latin-1") + b"\n")
    return path


def test_jsonl_that_is_not_utf8(tmp_path, model_dir):
    path = write_latin1_rows(tmp_path / "train.jsonl")
    proc = train(tmp_path, model_dir, f"data.train_files=[{path}]")
    assert_user_error(proc, str(path), "line 6", "not UTF-8")


def test_bad_rows_are_refused_before_the_training_stack_is_imported(tmp_path, model_dir):
    """The launch reads the rows itself (no tokenizer needed): a bad one exits 2 in about two
    seconds, before transformers or megatron-core is imported (torch is: the algorithm
    registries that validation looks names up in are torch modules)."""
    path = write_latin1_rows(tmp_path / "train.jsonl")
    launch = (
        "import sys\nfrom rlcli.cli import main\ntry:\n    main(sys.argv[1:])\n"
        "except SystemExit as stop:\n"
        "    heavy = [m for m in ('transformers', 'megatron') if m in sys.modules]\n"
        "    print('exit', stop.code, 'imported', heavy)\n"
    )
    args = [
        "train", str(REPO / "recipes" / "quickstart.yaml"), "data.synthetic=null",
        "model.build=false", f"model.path={model_dir}", f"data.train_files=[{path}]",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", launch, *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert "line 6" in proc.stderr and "not UTF-8" in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.strip() == "exit 2 imported []", (proc.stdout, proc.stderr[-3000:])


def test_model_build_without_a_task_to_train_its_tokenizer_is_refused(tmp_path):
    rows = write_rows(tmp_path / "train.jsonl", [good_row(i) for i in range(8)])
    proc = train(tmp_path, tmp_path / "to_build", f"data.train_files=[{rows}]", "model.build=true")
    assert_user_error(proc, "model.build needs text", "data.synthetic=arith")
    assert not (tmp_path / "to_build").exists()


@pytest.mark.dist
def test_user_error_in_the_ranks_of_nproc_2(tmp_path, model_dir):
    """Under --nproc 2 the ranks load the data (prompt lengths need the tokenizer): the parent
    prints their message once and exits 2, with no torchrun ChildFailedError report."""
    rows = write_rows(tmp_path / "train.jsonl", [good_row(i) for i in range(8)])
    proc = train(
        tmp_path,
        model_dir,
        f"data.train_files=[{rows}]",
        "data.max_prompt_length=2",
        "--nproc",
        "2",
    )
    assert_user_error(proc, str(rows), "longer than max_prompt_length=2")
    assert "ChildFailedError" not in proc.stderr + proc.stdout
    assert proc.stderr.count("error: all 8 prompts") == 1, proc.stderr[-3000:]


def write_tool_config(tmp_path: Path) -> Path:
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class: calculator\n")
    return path


def test_multi_turn_with_a_tokenizer_without_chat_template(tmp_path, model_dir):
    rows = write_rows(tmp_path / "train.jsonl", [good_row(i) for i in range(8)])
    proc = train(
        tmp_path,
        model_dir,
        f"data.train_files=[{rows}]",
        "rollout.multi_turn.enable=true",
        f"rollout.multi_turn.tool_config={write_tool_config(tmp_path)}",
    )
    assert_user_error(proc, f"model.path={model_dir}", "has none", "chat template")


def test_multi_turn_row_naming_a_tool_the_config_lacks(tmp_path):
    train_rows, _ = arith_split(num_max=10, num_val=10)
    spec = ModelBuildConfig(
        hidden_size=128,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=128,
        chat_template="chatml",
    )
    corpus = [e.prompt_text + e.response_text for e in train_rows]
    model = build_model_dir(spec, tmp_path / "chat_model", corpus, seed=0)
    rows = [good_row(i) for i in range(8)]
    rows[3]["extra_info"] = {"tools_kwargs": {"search": {"create_kwargs": {"k": 1}}}}
    path = write_rows(tmp_path / "train.jsonl", rows)
    proc = train(
        tmp_path,
        model,
        f"data.train_files=[{path}]",
        "data.max_prompt_length=64",  # the system prompt lists the tools
        "rollout.multi_turn.enable=true",
        f"rollout.multi_turn.tool_config={write_tool_config(tmp_path)}",
    )
    assert_user_error(proc, str(path), "line 4", "'search'", "tools: calculator")


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("rollout.multi_turn.max_assistant_turns=0", ["rollout.multi_turn.max_assistant_turns"]),
        ("rollout.multi_turn.format=xml", ["rollout.multi_turn.format", "hermes"]),
        ("rollout.multi_turn.tool_config=null", ["rollout.multi_turn.tool_config=FILE"]),
        ("rollout.multi_turn.max_response_tokenz=9", ["rollout.multi_turn.max_response_tokenz"]),
    ],
)
def test_bad_multi_turn_settings(tmp_path, model_dir, override, needles):
    rows = write_rows(tmp_path / "train.jsonl", [good_row(i) for i in range(8)])
    proc = train(
        tmp_path,
        model_dir,
        f"data.train_files=[{rows}]",
        "rollout.multi_turn.enable=true",
        f"rollout.multi_turn.tool_config={write_tool_config(tmp_path)}",
        override,
    )
    assert_user_error(proc, *needles)
