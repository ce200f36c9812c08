"""Shared helpers for tests/parallel: tiny HF checkpoints and torchrun launches.

    make_tiny_hf_model(out_dir, family="qwen2", tie_word_embeddings=False, seed=0,
                       head="causal_lm", **config_overrides)
        -> Path   (random transformers model saved as safetensors + config.json, fp32;
                   families: qwen2, llama, qwen3, qwen3_moe, qwen2_moe, qwen3_5, qwen3_5_moe, qwen3_next;
                   head="sequence_classification": a one-label reward model)
    run_torchrun(script, nproc, *args, timeout_s=600) -> str   (combined output; raises on failure
        with the first worker traceback, i.e. the failing assertion and its values, up front)

The tiny models are deliberately awkward: vocab 251 (odd, so TP padding is exercised), 4 layers
(2 per stage at PP2, 1 per virtual stage at PP2 x VPP2), GQA (4 heads, 2 KV groups), and a
non-default rope_theta. Qwen3 and the MoE families add what is theirs, awkward too: head_dim 32
with hidden 64 and 4 heads (so heads x head_dim != hidden, as in Qwen3-0.6B), 8 experts of width
32 with top-2 routing (renormalised for qwen3_moe, not for qwen2_moe), a dense MLP in layer 1
of qwen2_moe (`mlp_only_layers`) and its gated shared expert of width 48.
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


TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
FAMILY_CONFIG = {
    "qwen2": {},
    "llama": {},
    "qwen3": dict(head_dim=32),
    "qwen3_moe": dict(head_dim=32, norm_topk_prob=True, **TINY_MOE),
    "qwen2_moe": dict(
        norm_topk_prob=False, mlp_only_layers=[1], shared_expert_intermediate_size=48, **TINY_MOE
    ),
    # Qwen3.5 text: three Gated DeltaNet layers, then gated full attention (its own pattern of
    # 3:1); 2 key heads of 16 and 4 value heads of 16 split evenly at TP2; RoPE on a quarter of
    # each head (partial_rotary_factor 0.25, the config's default).
    "qwen3_5": dict(
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    ),
}
# Its mixture-of-experts siblings: the same hybrid layers, 8 experts top-2 and a shared expert;
# Qwen3-Next with its DeltaNet projections grouped by key head and layer 1 a dense MLP.
FAMILY_CONFIG["qwen3_5_moe"] = dict(
    FAMILY_CONFIG["qwen3_5"], shared_expert_intermediate_size=48, **TINY_MOE
)
FAMILY_CONFIG["qwen3_next"] = dict(
    FAMILY_CONFIG["qwen3_5_moe"], norm_topk_prob=True, mlp_only_layers=[1]
)
HYBRID_CLASSES = {  # family: (config class, causal LM, sequence classifier)
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "Qwen3_5TextForSequenceClassification"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", None),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", "Qwen3NextForSequenceClassification"),
}


def _model_classes(family: str, head: str = "causal_lm"):
    import transformers

    names = {
        "qwen2": "Qwen2",
        "llama": "Llama",
        "qwen3": "Qwen3",
        "qwen3_moe": "Qwen3Moe",
        "qwen2_moe": "Qwen2Moe",
    }
    suffix = {"causal_lm": "ForCausalLM", "sequence_classification": "ForSequenceClassification"}
    if family in HYBRID_CLASSES:  # Qwen3.5's text models are named apart from their family
        config, causal_lm, classifier = HYBRID_CLASSES[family]
        model = causal_lm if head == "causal_lm" else classifier
        return getattr(transformers, config), getattr(transformers, model)
    prefix = names[family]
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, prefix + suffix[head])


def make_tiny_hf_model(
    out_dir: str | os.PathLike,
    family: str = "qwen2",
    tie_word_embeddings: bool = False,
    seed: int = 0,
    head: str = "causal_lm",
    **config_overrides,
) -> Path:
    """Save a randomly initialised fp32 `family` model (see FAMILY_CONFIG) to `out_dir`: a
    causal LM, or with `head="sequence_classification"` a reward model (num_labels 1)."""
    config_cls, model_cls = _model_classes(family, head)
    if head == "sequence_classification":
        config_overrides = {"num_labels": 1, **config_overrides}
    options = {
        **TINY_CONFIG,
        **FAMILY_CONFIG[family],
        "tie_word_embeddings": tie_word_embeddings,
        **config_overrides,
    }
    rope = {"rope_type": "default", "rope_theta": options.pop("rope_theta")}
    if family in HYBRID_CLASSES:
        rope["partial_rotary_factor"] = 0.25
    config = config_cls(**options, rope_parameters=rope)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    # HF initialises norms to 1 and biases to 0; randomise them so a mapping mistake shows up.
    # Routers get a wider spread than the other weights: clear top-k choices, no near-ties that
    # rounding could flip between implementations.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1)
            elif name.endswith("dt_bias"):  # HF starts it at ones: a split error would not show
                param.normal_(mean=1.0, std=0.3)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(std=0.5)
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
