"""Megatron <-> HF parity per parallel layout (torchrun, gloo, tiny fp32 Qwen2 / Llama).

One torchrun launch per layout runs every check (see parity_worker.py): Megatron logits vs HF
transformers logits, HF -> Megatron -> HF bit-exact round trip (iter_hf_weights and
save_hf_checkpoint), and equal random weights on data-parallel replicas.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.parallel.dist_utils import run_torchrun

WORKER = Path(__file__).with_name("parity_worker.py")
LOGIT_TOLERANCE = 1e-4
# sequence parallelism needs TE (megatron's local-spec norm rejects it); checked only with TE
HAVE_TRANSFORMER_ENGINE = importlib.util.find_spec("transformer_engine") is not None

LAYOUTS = [
    # (tp, pp, vpp, processes): tp1 x pp1 on 2 processes is dp=2
    pytest.param(1, 1, None, 2, id="tp1-pp1-dp2"),
    pytest.param(2, 1, None, 2, id="tp2"),
    pytest.param(1, 2, None, 2, id="pp2"),
    pytest.param(2, 2, None, 4, id="tp2-pp2"),
    pytest.param(1, 2, 2, 2, id="pp2-vpp2"),
]


@pytest.mark.dist
@pytest.mark.parametrize("tp, pp, vpp, nproc", LAYOUTS)
def test_megatron_matches_hf(
    tp, pp, vpp, nproc, tiny_qwen2_dir, tiny_qwen2_tied_dir, tiny_llama_dir, tmp_path
):
    models = [tiny_qwen2_dir, tiny_qwen2_tied_dir, tiny_llama_dir]
    if vpp:
        models = [tiny_qwen2_tied_dir]  # interleaving adds no new mapping; keep the launch short
    result = tmp_path / "result.json"
    args = ["--tp", tp, "--pp", pp, "--models", ",".join(map(str, models))]
    args += ["--result", result, "--export-dir", tmp_path / "export"]
    if vpp:
        args += ["--vpp", vpp]
    run_torchrun(WORKER, nproc, *args)

    summary = json.loads(result.read_text())
    print(json.dumps(summary, indent=1))  # parity numbers, visible with -s
    assert summary["dp"] == nproc // (tp * pp)
    for model_dir in models:
        report = summary[model_dir.name]
        assert report["max_abs_logit_diff"] < LOGIT_TOLERANCE, (model_dir.name, report)
        assert report["round_trip_missing"] == [] and report["round_trip_extra"] == []
        assert report["round_trip_exact"], (model_dir.name, report)
        assert report["dp_replicas_equal"], (model_dir.name, report)
    first = summary[models[0].name]
    assert first["saved_exact"] and first["saved_config_ok"], first
    assert first["ddp_wrapped_round_trip_exact"], first
    assert first["critic_max_abs_value_diff"] < LOGIT_TOLERANCE, first
    assert first["critic_exports_score"] == ["score.bias", "score.weight"], first
    if tp > 1 and HAVE_TRANSFORMER_ENGINE:
        assert first["sequence_parallel_max_abs_logit_diff"] < LOGIT_TOLERANCE, first
