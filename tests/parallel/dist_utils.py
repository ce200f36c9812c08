"""Shared helpers for tests/parallel: tiny HF checkpoints and torchrun launches.

    make_tiny_hf_model(out_dir, family="qwen2", tie_word_embeddings=False, seed=0,
                       head="causal_lm", **config_overrides)
        -> Path   (random transformers model saved as safetensors + config.json, fp32;
                   head="sequence_classification": a one-label reward model)
    run_torchrun(script, nproc, *args, timeout_s=600) -> str   (combined output; raises on failure
        with the first worker traceback, i.e. the failing assertion and its values, up front)

The tiny models are deliberately awkward: vocab 251 (odd, so TP padding is exercised), 4 layers
(2 per stage at PP2, 1 per virtual stage at PP2 x VPP2), GQA (4 heads, 2 KV groups), and a
non-default rope_theta.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]

TINY_CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=251,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=50000.0,
)


def make_tiny_hf_model(
    out_dir: str | os.PathLike,
    family: str = "qwen2",
    tie_word_embeddings: bool = False,
    seed: int = 0,
    head: str = "causal_lm",
    **config_overrides,
) -> Path:
    """Save a randomly initialised fp32 `family` ("qwen2" or "llama") model to `out_dir`: a
    causal LM, or with `head="sequence_classification"` a reward model (num_labels 1)."""
    import transformers
    from transformers import LlamaConfig, Qwen2Config

    configs = {"qwen2": Qwen2Config, "llama": LlamaConfig}
    suffix = {"causal_lm": "ForCausalLM", "sequence_classification": "ForSequenceClassification"}
    config_cls = configs[family]
    model_cls = getattr(transformers, config_cls.__name__.removesuffix("Config") + suffix[head])
    if head == "sequence_classification":
        config_overrides = {"num_labels": 1, **config_overrides}
    options = {**TINY_CONFIG, "tie_word_embeddings": tie_word_embeddings, **config_overrides}
    rope_theta = options.pop("rope_theta")
    config = config_cls(
        **options, rope_parameters={"rope_type": "default", "rope_theta": rope_theta}
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    # HF initialises norms to 1 and biases to 0; randomise them so a mapping mistake shows up.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def run_process_group(
    cmd: list[str], *, env: dict[str, str], cwd: str | os.PathLike, timeout_s: int
) -> tuple[int, str]:
    """Run `cmd` in its own session; on timeout kill the whole group (torchrun's workers too, which
    `subprocess.run` would leave behind) and fail. Returns (returncode, stdout + stderr)."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"{' '.join(cmd)} timed out after {timeout_s} s:\n{stderr[-6000:]}"
        ) from None
    return proc.returncode, stdout + stderr


def run_torchrun(script: str | os.PathLike, nproc: int, *args: str, timeout_s: int = 600) -> str:
    """Run `script` under `torch.distributed.run --standalone --nproc_per_node nproc` with gloo-
    friendly settings (OMP_NUM_THREADS=1, repo on PYTHONPATH). Returns stdout+stderr; raises
    AssertionError with the output tail when any rank fails."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "PYTHONWARNINGS": "ignore",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", str(script), *map(str, args)]
    returncode, output = run_process_group(cmd, env=env, cwd=REPO_ROOT, timeout_s=timeout_s)
    if returncode != 0:
        error = first_traceback(output) or "(no Python traceback in the output)"
        raise AssertionError(
            f"{Path(script).name} failed under torchrun ({returncode}); the first worker error:\n"
            f"{error}\n--- the output's end ---\n{output[-3000:]}"
        )
    return output


def first_traceback(output: str) -> str | None:
    """The first Python traceback in ``output``: its frames and the exception line(s) after them
    (for a failed ``assert x < tol, (name, values)`` that line shows the values)."""
    lines = output.splitlines()
    for start, line in enumerate(lines):
        if line.strip() == "Traceback (most recent call last):":
            end = start + 1
            while end < len(lines) and (lines[end].startswith(" ") or not lines[end].strip()):
                end += 1  # the frames are indented; the exception line is not
            return "\n".join(lines[start : end + 1])
    return None
