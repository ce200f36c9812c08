"""Megatron <-> HF parity per parallel layout (torchrun, gloo, tiny fp32 Qwen2 / Llama / Qwen3 /
Qwen3-MoE / Qwen2-MoE, and the hybrids of Gated DeltaNet and gated attention: Qwen3.5 text,
Qwen3.5-MoE text and Qwen3-Next).

One torchrun launch per process count runs every check of its layouts, one layout after the
other (see parity_worker.py): Megatron logits vs HF
transformers logits, HF -> Megatron -> HF bit-exact round trip (iter_hf_weights and
save_hf_checkpoint), equal random weights on data-parallel replicas, and for MoE models the
same top-k expert choice as HF's router for every token in every layer (at TP1 x PP1, EP1 and
EP2, also the router load metrics and aux loss against HF's choices and probabilities). The MoE
layouts: TP1 x DP2 (EP1), TP2 (experts split by expert TP = 2), PP2, EP2 (4 experts per rank,
DP2) and TP2 x EP2 with expert TP 1 (attention split over 2 ranks, experts spread over the
same 2). The MoE models share the dense models' launches where their layouts coincide.
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

DENSE = ["tiny_qwen2_dir", "tiny_qwen2_tied_dir", "tiny_llama_dir"]
NEW = ["tiny_qwen3_dir", "tiny_qwen3_moe_dir", "tiny_qwen2_moe_dir", "tiny_qwen3_5_dir"]
HYBRID_MOE = ["tiny_qwen3_5_moe_dir", "tiny_qwen3_next_dir"]  # Gated DeltaNet + experts
MOE = ["tiny_qwen3_moe_dir", "tiny_qwen2_moe_dir", *HYBRID_MOE]
LAYOUTS = [
    # (tp, pp, vpp, ep, expert tp, processes, models): tp1 x pp1 on 2 processes is dp=2.
    # The first model of a layout also runs the export, DDP and critic checks.
    pytest.param(1, 1, None, 1, None, 2, DENSE + MOE + ["tiny_qwen3_5_dir"], id="tp1-pp1-dp2"),
    pytest.param(2, 1, None, 1, None, 2, DENSE + NEW + HYBRID_MOE, id="tp2"),
    pytest.param(1, 2, None, 1, None, 2, DENSE + NEW, id="pp2"),
    pytest.param(2, 2, None, 1, None, 4, DENSE, id="tp2-pp2"),
    # interleaving adds no new mapping; keep the launch short
    pytest.param(1, 2, 2, 1, None, 2, ["tiny_qwen2_tied_dir"], id="pp2-vpp2"),
    pytest.param(1, 1, None, 2, None, 2, MOE, id="ep2"),
    pytest.param(2, 1, None, 2, 1, 2, MOE[:2], id="tp2-ep2-etp1"),
]


@pytest.fixture(scope="module")
def summaries(request, tmp_path_factory) -> dict[str, dict]:
    """The summary of every selected layout, by id: one torchrun launch per process count (a
    launch's startup, imports and process group serve all its layouts)."""
    selected = {
        item.callspec.id: item.callspec.params
        for item in request.session.items
        if item.originalname == "test_megatron_matches_hf" and hasattr(item, "callspec")
    }
    by_nproc: dict[int, list[dict]] = {}
    results = {}
    for layout_id, params in selected.items():
        folder = tmp_path_factory.mktemp(layout_id)
        models = [request.getfixturevalue(name) for name in params["fixtures"]]
        layout = {key: params[key] for key in ("tp", "pp", "vpp", "ep", "etp")}
        layout["models"] = ",".join(map(str, models))
        layout["result"] = str(folder / "result.json")
        layout["export_dir"] = str(folder / "export")
        by_nproc.setdefault(params["nproc"], []).append(layout)
        results[layout_id] = Path(layout["result"])
    for nproc, layouts in by_nproc.items():
        plan = tmp_path_factory.mktemp("plan") / f"nproc{nproc}.json"
        plan.write_text(json.dumps(layouts))
        run_torchrun(WORKER, nproc, "--plan", plan)
    return {layout_id: json.loads(path.read_text()) for layout_id, path in results.items()}


@pytest.mark.dist
@pytest.mark.parametrize("tp, pp, vpp, ep, etp, nproc, fixtures", LAYOUTS)
def test_megatron_matches_hf(tp, pp, vpp, ep, etp, nproc, fixtures, request, summaries):
    models = [request.getfixturevalue(name) for name in fixtures]
    summary = summaries[request.node.callspec.id]
    print(json.dumps(summary, indent=1))  # parity numbers, visible with -s
    assert summary["dp"] == nproc // (tp * pp)
    assert (summary["ep"], summary["etp"]) == (ep, etp or tp)
    for model_dir, fixture in zip(models, fixtures, strict=True):
        report = summary[model_dir.name]
        assert report["max_abs_logit_diff"] < LOGIT_TOLERANCE, (model_dir.name, report)
        assert report["round_trip_missing"] == [] and report["round_trip_extra"] == []
        assert report["round_trip_exact"], (model_dir.name, report)
        assert report["dp_replicas_equal"], (model_dir.name, report)
        assert report["plan_counts_match"] and report["plan_weight_bytes_match"], report
        assert report.get("router_choices_equal") is (True if fixture in MOE else None), report
        if fixture in MOE and tp == pp == 1:  # parallel.moe.router_load_metrics vs HF's routing
            assert report["router_metrics_match"], report
    first = summary[models[0].name]
    assert first["saved_exact"] and first["saved_config_ok"], first
    assert first["ddp_wrapped_round_trip_exact"], first
    assert first["critic_max_abs_value_diff"] < LOGIT_TOLERANCE, first
    assert first["critic_exports_score"] == ["score.bias", "score.weight"], first
    if tp > 1 and HAVE_TRANSFORMER_ENGINE:
        assert first["sequence_parallel_max_abs_logit_diff"] < LOGIT_TOLERANCE, first
