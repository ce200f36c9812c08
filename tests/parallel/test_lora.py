"""LoRA adapters on Megatron (parallel.lora, parallel.lora_io) against HF transformers + PEFT.

The multi-process checks run in one torchrun launch (lora_worker.py: TP2, PP2, TP1 x DP2, each
rank computing TP1 numerics at DP2); the adapters they compare with are written by PEFT itself
here, with random A and B, so that a wrong mapping cannot hide behind B = 0.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from parallel.lora import LoraConfigError, LoraSpec, lora_modules
from parallel.model_shapes import LORA_TARGET_MODULES, ModelShape, lora_stage_params
from tests.parallel.dist_utils import TINY_CONFIG, run_torchrun

WORKER = Path(__file__).with_name("lora_worker.py")
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LOGIT_TOLERANCE = 1e-4  # test_convert_parity's Megatron-vs-HF tolerance (fp32)
GRAD_TOLERANCE = 1e-5


def make_peft_adapter(hf_dir: Path, out_dir: Path, *, r=4, alpha=8, targets=HF_TARGETS, seed=0):
    """A PEFT LoRA adapter for `hf_dir`, random A and B (std 0.05), saved by PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def adapters(tiny_qwen2_dir, tmp_path_factory) -> dict[str, Path]:
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("lora_adapters")
    peft_dir = make_peft_adapter(tiny_qwen2_dir, root / "peft")
    bad_shape = root / "bad_shape"
    shutil.copytree(peft_dir, bad_shape)
    tensors = load_file(bad_shape / "adapter_model.safetensors")
    name = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
    tensors[name] = tensors[name][:-4].clone()  # 28 rows where the model has 32
    save_file(tensors, bad_shape / "adapter_model.safetensors")
    return {
        "peft": peft_dir,
        "bad_rank": make_peft_adapter(tiny_qwen2_dir, root / "rank2", r=2, alpha=8),
        "bad_shape": bad_shape,
        "qv_only": make_peft_adapter(tiny_qwen2_dir, root / "qv", targets=["q_proj", "v_proj"]),
    }


@pytest.mark.dist
def test_lora_matches_peft_at_tp2_pp2_dp2(
    tiny_qwen2_dir, tiny_qwen2_tied_dir, tiny_qwen3_5_dir, adapters, tmp_path
):
    result = tmp_path / "result.json"
    args = ["--untied", tiny_qwen2_dir, "--tied", tiny_qwen2_tied_dir]
    args += ["--peft", adapters["peft"], "--bad-rank", adapters["bad_rank"]]
    args += ["--bad-shape", adapters["bad_shape"], "--qv-only", adapters["qv_only"]]
    hybrid_peft = make_peft_adapter(tiny_qwen3_5_dir, tmp_path / "hybrid_peft")
    args += ["--hybrid", tiny_qwen3_5_dir, "--hybrid-peft", hybrid_peft]
    args += ["--out", tmp_path / "out", "--result", result]
    run_torchrun(WORKER, 2, *args, timeout_s=900)
    reports = json.loads(result.read_text())
    print(json.dumps(reports, indent=1))  # the numbers, shown with -s
    assert set(reports) == {"tp2-pp1-dp1", "tp1-pp2-dp1", "tp1-pp1-dp2", "hybrid-tp2"}
    for layout, report in reports.items():
        for check in (
            "b_zero_bit_exact",
            "adapter_params_as_planned",
            "disabled_is_base",
            "adapter_stream_is_peft_file",
            "unmerged_is_base_file",
            "grad_buffer_only_adapters",
            "optimizer_state_only_adapters",
            "base_unchanged_by_step",
            "every_adapter_tensor_stepped",
        ):
            assert report[check] is True, (layout, check, report)
        assert report["logits_vs_peft"] < LOGIT_TOLERANCE, (layout, report)
        assert report["merged_vs_peft_merge_and_unload"] < 1e-6, (layout, report)
        assert report["grads_vs_peft"] < GRAD_TOLERANCE, (layout, report)
        assert report["exported_logits_vs_megatron"] < LOGIT_TOLERANCE, (layout, report)
        assert report["exported_config"]["r"] == 4 and report["exported_config"]["lora_alpha"] == 8
        assert report["exported_targets"] == sorted(HF_TARGETS), report
    tp2 = reports["tp2-pp1-dp1"]
    assert tp2["checkpoint_full_adapter_shapes"] and tp2["checkpoint_round_trip"], tp2
    assert tp2["dropout_eval_vs_peft"] < LOGIT_TOLERANCE, tp2
    assert tp2["dropout_train_changes_logits"] and tp2["dropout_replicated_equal_over_tp"], tp2
    dp2 = reports["tp1-pp1-dp2"]
    assert dp2["distributed_optimizer_state_is_adapters"], dp2
    assert dp2["distributed_grad_buffer_only_adapters"], dp2
    assert dp2["full_recompute_grads_vs_peft"] < GRAD_TOLERANCE, dp2
    assert "actor.lora.rank" in dp2["bad_rank"] and "r=2" in dp2["bad_rank"], dp2
    assert "layers.1.self_attn.k_proj.lora_B" in dp2["bad_shape"], dp2
    assert "shape [28, 4]" in dp2["bad_shape"], dp2
    assert "actor.lora.target_modules" in dp2["qv_only"], dp2


@pytest.mark.parametrize(
    ("spec", "key"),
    [
        (LoraSpec(rank=0, alpha=8), "actor.lora.rank=0"),
        (LoraSpec(rank=-2, alpha=8), "actor.lora.rank=-2"),
        (LoraSpec(rank=4, alpha=0), "actor.lora.alpha=0"),
        (LoraSpec(rank=4, alpha=8, dropout=1.0), "actor.lora.dropout=1.0"),
        (LoraSpec(rank=4, alpha=8, target_modules=("q_proj",)), "no linear 'q_proj'"),
        (LoraSpec(rank=4, alpha=8, target_modules=()), "actor.lora.target_modules=[]"),
    ],
)
def test_bad_lora_settings_name_the_key(spec, key):
    with pytest.raises(LoraConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        spec.targets()
    assert issubclass(LoraConfigError, ValueError)


def test_targets_select_hf_modules_as_peft_names_them(tiny_qwen2_dir):
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(tiny_qwen2_dir)
    spec = LoraSpec(rank=4, alpha=8, target_modules=("linear_fc1", "linear_qkv"))
    layer0 = [m.hf_module for m in lora_modules(hf_config, spec) if m.layer == 0]
    assert layer0 == [f"model.layers.0.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj")] + [
        f"model.layers.0.{n}" for n in ("self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    ]
    everything = LoraSpec(rank=4, alpha=8, target_modules=("all",))
    assert everything.targets() == LORA_TARGET_MODULES


def test_lora_parameter_count_worked_by_hand():
    # hidden 64, 4 heads of 16, 2 KV heads, ffn 96, rank 4, TP2, one layer per stage of 2:
    # q: A 4*64 + B 64/2*4; k, v: 4*64 + 32/2*4 each; o (row): A 4*64/2 + B 64*4;
    # gate, up: 4*64 + 96/2*4 each; down (row): A 4*96/2 + B 64*4.
    shape = ModelShape.from_hf_config({**TINY_CONFIG, "num_hidden_layers": 2})
    by_hand = (256 + 128) + 2 * (256 + 64) + (128 + 256) + 2 * (256 + 192) + (192 + 256)
    count = lora_stage_params(shape, tp=2, pp=2, rank=4, target_modules=LORA_TARGET_MODULES)
    assert count == by_hand == 2752


def test_memory_terms_count_only_adapters_as_trainable():
    from parallel.memory_terms import TrainedModel, grad_bytes, optimizer_bytes, weight_bytes
    from parallel.model_shapes import KNOWN_SHAPES

    full = TrainedModel(KNOWN_SHAPES["qwen2.5-7b"], dtype="bfloat16", tp=2, dp=4)
    lora = TrainedModel(KNOWN_SHAPES["qwen2.5-7b"], dtype="bfloat16", tp=2, dp=4, lora_rank=32)
    adapters = lora_stage_params(
        lora.shape, tp=2, pp=1, rank=32, target_modules=LORA_TARGET_MODULES
    )
    assert lora.lora_params == adapters and full.lora_params == 0
    assert grad_bytes(lora) == 4 * adapters  # fp32 gradient buffer of the adapters only
    assert optimizer_bytes(lora) == 4 * 3 * adapters  # fp32 master + Adam's two moments
    assert weight_bytes(lora) == 2 * (full.params + adapters)  # the frozen base stays resident
    assert grad_bytes(lora) < grad_bytes(full) / 50


def test_hybrid_layers_adapt_attention_only_where_there_is_attention(tiny_qwen3_5_dir):
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(tiny_qwen3_5_dir)  # 3 DeltaNet layers, then attention
    spec = LoraSpec(rank=4, alpha=8, target_modules=("all",))
    modules = lora_modules(hf_config, spec)
    delta_net = [m.hf_module.rpartition(".")[2] for m in modules if m.layer == 0]
    assert delta_net == ["gate_proj", "up_proj", "down_proj"]
    attention = {m.hf_module.rpartition(".")[2]: m for m in modules if m.layer == 3}
    assert list(attention) == HF_TARGETS
    # q_proj makes 4 heads x 32 queries and as many gate rows; k and v 2 heads x 32
    assert attention["q_proj"].out_features == 2 * 4 * 32 and attention["k_proj"].out_features == 64
