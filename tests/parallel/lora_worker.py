"""torchrun worker (2 processes) for test_lora.py: LoRA at TP2, PP2 and TP1 x DP2, one launch.

    lora_worker.py --untied DIR --tied DIR --peft DIR --bad-rank DIR --bad-shape DIR
        --qv-only DIR --out DIR --result FILE.json

The PEFT adapter folders are written by PEFT itself (test_lora.py); the Megatron side must
compute what HF transformers + PEFT compute with them. For each layout (megatron's parallel
state rebuilt in between; PP2 uses the tied-embedding model, whose frozen embedding copy on the
last stage must not break the embedding-gradient all-reduce):

  * adapters with B = 0 leave the logits bit-identical to the base model's;
  * the adapter parameters on each rank number what parallel.model_shapes.lora_stage_params says;
  * with PEFT's adapter loaded: logits vs PeftModel.from_pretrained (fp32); inside
    lora_disabled() the logits are the base's again, bit for bit;
  * the adapter stream (iter_adapter_buckets) gives PEFT's file back bit for bit; the merged
    buckets equal PEFT's merge_and_unload() weights; the unmerged buckets equal the base file
    bit for bit (the merge never touches the trainer's base);
  * DDP + optimizer: gradient buffers and optimizer state hold only adapter parameters; one
    train_step's adapter gradients equal PEFT's for the same global-mean NLL; the step changes
    the adapters and no base parameter;
  * save_peft_adapter writes a folder PEFT loads: tensors equal to the model's, logits equal to
    Megatron's after the step;
  * TP2: a megatron dist checkpoint holds the adapters at their full shapes and loads back;
  * a Qwen3.5 text model (`--hybrid`) at TP2: the checks above but the checkpoint, dropout and
    DP extras (adapters on its gated attention and MLPs, none in its Gated DeltaNet layers);
  * DP2: the distributed optimizer's state is the adapters' (summed over DP); full activation
    recomputation still gives PEFT's gradients (the first layer's adapters included); a bad
    starting adapter (rank, shape, missing modules) raises LoraConfigError naming the key.
Rank 0 writes {layout: {check: value}} to --result.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from parallel.checkpoint import load_checkpoint, save_checkpoint
from parallel.convert.mapping import unwrap_chunk
from parallel.hf_model import load_hf_model
from parallel.lora import LoraConfigError, LoraSpec, adapter_params, apply_lora, lora_disabled
from parallel.lora_io import load_peft_adapter, save_peft_adapter
from parallel.mesh import Mesh, init_parallel
from parallel.model_options import ModelBuildOptions, Recompute
from parallel.model_shapes import LORA_TARGET_MODULES, ModelShape, lora_stage_params
from parallel.optim import (
    OptimizerSettings,
    build_optimizer,
    sub_optimizers,
    train_step,
    wrap_for_training,
)
from parallel.parity import megatron_logits, round_trip_equal
from parallel.reshard import iter_adapter_buckets, iter_inference_buckets
from parallel.step_types import LossReport, MicroBatch, ModelOutputs
from rlcli.process_lifetime import exit_skipping_teardown

SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("all",))
ROWS, SEQ = 4, 10
LAYOUTS = [(2, 1, "untied"), (1, 2, "tied"), (1, 1, "untied")]  # (tp, pp, model); 1x1 is DP2


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    input_ids = torch.randint(0, vocab, (ROWS, SEQ), generator=generator)
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    mask[1, 6:] = mask[3, 8:] = 0
    return input_ids * mask, mask


def all_true(flag: bool) -> bool:
    value = torch.tensor([0.0 if flag else 1.0])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item() == 0.0


def world_max(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def peft_model(hf_dir: str, adapter_dir: str, trainable: bool = False):
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir, is_trainable=trainable)


def logits_diff(models, mesh: Mesh, tokens: torch.Tensor, reference: torch.Tensor) -> float:
    """max |Megatron - reference| of the logits, the same number on every rank."""
    logits = megatron_logits([unwrap_chunk(m) for m in models], mesh, tokens)
    diff = (logits - reference).abs().max().item() if logits is not None else 0.0
    return world_max(diff)


def mean_nll(outputs: ModelOutputs, micro_batch: MicroBatch, global_tokens: float, dp: int):
    mask = micro_batch.attention_mask[:, 1:].float()
    return -(outputs.log_probs * mask).sum() * dp / global_tokens, LossReport()


def peft_grads(hf_dir: str, adapter_dir: str, input_ids, mask) -> dict[str, torch.Tensor]:
    """PEFT's gradients of the global-mean next-token NLL, by PEFT file name."""
    model = peft_model(hf_dir, adapter_dir, trainable=True)
    log_p = torch.log_softmax(model(input_ids=input_ids).logits[:, :-1], dim=-1)
    picked = log_p.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    weights = mask[:, 1:].float()
    (-(picked * weights).sum() / weights.sum()).backward()
    return {
        name.replace(".default.weight", ".weight"): p.grad
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def full_adapter_grads(models, mesh: Mesh) -> dict[str, torch.Tensor]:
    """This rank's adapter gradients (DDP's main_grad), gathered over TP, by PEFT name."""
    grads = {}
    for entry in adapter_params(models):
        grad = entry.param.main_grad.detach()
        if entry.partition_dim is not None and mesh.tp > 1:
            shards = [torch.empty_like(grad) for _ in range(mesh.tp)]
            dist.all_gather(shards, grad.contiguous(), group=mesh.tp_group)
            grad = torch.cat(shards, dim=entry.partition_dim)
        grads[f"base_model.model.{entry.hf_module}.lora_{entry.matrix}.weight"] = grad
    return grads


def grad_diff(models, mesh: Mesh, reference: dict[str, torch.Tensor]) -> float:
    mine = full_adapter_grads(models, mesh)
    ok = all(name in reference for name in mine) and len(mine) > 0
    diff = max((mine[n] - reference[n]).abs().max().item() for n in mine) if ok else float("inf")
    return world_max(diff)


def lora_model(
    hf_dir: str,
    mesh: Mesh,
    adapter_dir: str | None,
    spec=SPEC,
    options: ModelBuildOptions = ModelBuildOptions(),
):
    models = load_hf_model(hf_dir, mesh, options=options)
    apply_lora(models, spec)
    if adapter_dir is not None:
        load_peft_adapter(models, mesh, adapter_dir)
    return models


def trained(models, mesh: Mesh, distributed: bool = False):
    models = wrap_for_training(models, mesh, use_distributed_optimizer=distributed)
    optimizer, scheduler = build_optimizer(
        models, OptimizerSettings(lr=1e-2, clip_grad=0.0, use_distributed_optimizer=distributed)
    )
    return models, optimizer, scheduler


def step(models, mesh: Mesh, optimizer, scheduler, input_ids, mask) -> None:
    rows = ROWS // mesh.dp
    mine = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
    tokens = mask[:, 1:].sum().item()
    micro = [MicroBatch(input_ids=input_ids[mine], attention_mask=mask[mine])]
    result = train_step(
        models,
        mesh,
        optimizer,
        scheduler,
        micro,
        lambda out, mb: mean_nll(out, mb, tokens, mesh.dp),
    )
    assert not result.skipped, result


def optimizer_state_numel(optimizer) -> int:
    parts = sub_optimizers(optimizer)
    return sum(
        state["exp_avg"].numel() for part in parts for state in part.optimizer.state.values()
    )


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() <= 1e-5)


def check_layout(mesh: Mesh, hf_dir: str, args) -> dict:
    hf_config = AutoConfig.from_pretrained(hf_dir)
    input_ids, mask = batch(hf_config.vocab_size)
    report: dict = {}

    models = load_hf_model(hf_dir, mesh)
    base_logits = megatron_logits(models, mesh, input_ids)
    apply_lora(models, SPEC)
    zero_b = megatron_logits(models, mesh, input_ids)
    # megatron-core 0.19 compiles the gated attention's and the DeltaNet's fused gates with
    # torch.compile, whose graph for frozen weights rounds differently (1e-6) from the trainable
    # one's: the hybrid model is held to that, the others to the bit.
    same = _close if args.hybrid_layout else torch.equal
    report["b_zero_bit_exact"] = all_true(base_logits is None or same(zero_b, base_logits))
    counted = sum(p.param.numel() for p in adapter_params(models))
    shape = ModelShape.from_hf_config(hf_config.to_dict())
    planned = lora_stage_params(
        shape, tp=mesh.tp, pp=mesh.pp, rank=SPEC.rank, target_modules=LORA_TARGET_MODULES
    )
    report["adapter_params_as_planned"] = all_true(counted == planned)
    report["adapter_params_per_rank"] = counted

    load_peft_adapter(models, mesh, args.peft)
    reference = peft_model(hf_dir, args.peft)
    with torch.no_grad():
        peft_logits = reference(input_ids).logits
    report["logits_vs_peft"] = logits_diff(models, mesh, input_ids, peft_logits)
    with lora_disabled(models):
        disabled = megatron_logits(models, mesh, input_ids)
    report["disabled_is_base"] = all_true(base_logits is None or same(disabled, base_logits))

    on_disk = load_file(Path(args.peft) / "adapter_model.safetensors")
    streamed = {n: t.clone() for b in iter_adapter_buckets(models, mesh) for n, t in b}
    report["adapter_stream_is_peft_file"] = all_true(
        streamed.keys() == on_disk.keys()
        and all(torch.equal(streamed[n], on_disk[n]) for n in on_disk)
    )
    merged_reference = peft_model(hf_dir, args.peft).merge_and_unload().state_dict()
    merged = {n: t.clone() for b in iter_inference_buckets(models, mesh, 0.05) for n, t in b}
    same_names = all(n in merged_reference for n in merged)
    report["merged_vs_peft_merge_and_unload"] = world_max(
        max((merged[n] - merged_reference[n]).abs().max().item() for n in merged)
        if same_names
        else float("inf")
    )
    base_file = load_file(Path(hf_dir) / "model.safetensors")
    unmerged = {n: t.clone() for b in iter_inference_buckets(models, mesh, 0, False) for n, t in b}
    report["unmerged_is_base_file"] = all_true(  # a zero-centred norm: up to 1 + w's rounding
        unmerged.keys() == base_file.keys()
        and all(round_trip_equal(hf_config, n, unmerged[n], base_file[n]) for n in base_file)
    )

    base_before = [
        p.detach().clone() for m in models for p in m.parameters() if not p.requires_grad
    ]
    adapters_before = [e.param.detach().clone() for e in adapter_params(models)]
    models, optimizer, scheduler = trained(models, mesh)
    buffer_params = {id(p) for chunk in models for buf in chunk.buffers for p in buf.params}
    adapter_ids = {id(e.param) for e in adapter_params(models)}
    report["grad_buffer_only_adapters"] = all_true(
        buffer_params == adapter_ids
        and sum(buf.numel_unpadded for chunk in models for buf in chunk.buffers) == counted
    )
    step(models, mesh, optimizer, scheduler, input_ids, mask)
    report["optimizer_state_only_adapters"] = all_true(optimizer_state_numel(optimizer) == counted)
    reference_grads = peft_grads(hf_dir, args.peft, input_ids, mask)
    report["grads_vs_peft"] = grad_diff(models, mesh, reference_grads)
    base_after = [p.detach() for m in models for p in m.parameters() if not p.requires_grad]
    report["base_unchanged_by_step"] = all_true(
        all(torch.equal(a, b) for a, b in zip(base_before, base_after, strict=True))
    )
    changed = [
        not torch.equal(before, e.param.detach())
        for before, e in zip(adapters_before, adapter_params(models), strict=True)
    ]
    report["every_adapter_tensor_stepped"] = all_true(all(changed))

    out = Path(args.out) / f"tp{mesh.tp}pp{mesh.pp}"
    save_peft_adapter(models, mesh, out, base_model_name_or_path=hf_dir)
    exported = peft_model(hf_dir, str(out))
    with torch.no_grad():
        exported_logits = exported(input_ids).logits
    report["exported_logits_vs_megatron"] = logits_diff(models, mesh, input_ids, exported_logits)
    saved = json.loads((out / "adapter_config.json").read_text())
    report["exported_config"] = {
        k: saved[k] for k in ("r", "lora_alpha", "base_model_name_or_path")
    }
    report["exported_targets"] = sorted(saved["target_modules"])

    if mesh.tp > 1 and not args.hybrid_layout:
        report.update(check_checkpoint(models, mesh, hf_dir, Path(args.out) / "ckpt", input_ids))
        report.update(check_dropout(mesh, hf_dir, args, input_ids, mask, peft_logits))
    if mesh.dp > 1 and not args.hybrid_layout:
        report.update(check_dp_extras(mesh, hf_dir, args, input_ids, mask, counted))
    return report


def check_checkpoint(models, mesh: Mesh, hf_dir: str, ckpt: Path, tokens) -> dict:
    """megatron's sharded state dict and a save / load of the adapters (TP-split tensors)."""
    sharded = models[0].module.sharded_state_dict()
    # Keyed by the parameter's local name; each shape has the stacked layers in front.
    shapes = {k: tuple(v.global_shape[1:]) for k, v in sharded.items() if "_lora." in k}
    expected = {}
    for entry in adapter_params(models):
        full = list(entry.param.shape)
        if entry.partition_dim is not None:
            full[entry.partition_dim] *= mesh.tp
        expected[entry.global_name] = tuple(full)  # global == local names at PP1
    report = {"checkpoint_full_adapter_shapes": all_true(shapes == expected)}
    save_checkpoint(ckpt, models, mesh)
    fresh = lora_model(hf_dir, mesh, None)
    load_checkpoint(ckpt, fresh, mesh)
    report["checkpoint_round_trip"] = all_true(
        all(
            torch.equal(a.param, b.param)
            for a, b in zip(adapter_params(models), adapter_params(fresh), strict=True)
        )
    )
    return report


def check_dropout(mesh: Mesh, hf_dir: str, args, input_ids, mask, peft_logits) -> dict:
    """Adapter dropout: off in eval mode (PEFT's logits), on in train mode; the adapter tensors
    replicated over TP stay equal after a step (TP ranks draw the same masks where the input
    is replicated)."""
    models = lora_model(hf_dir, mesh, args.peft, spec=LoraSpec(rank=4, alpha=8.0, dropout=0.3))
    for chunk in models:
        chunk.eval()
    report = {"dropout_eval_vs_peft": logits_diff(models, mesh, input_ids, peft_logits)}
    for chunk in models:
        chunk.train()
    first, second = (megatron_logits(models, mesh, input_ids) for _ in range(2))
    report["dropout_train_changes_logits"] = all_true(
        first is None or not torch.equal(first, second)
    )
    models, optimizer, scheduler = trained(models, mesh)
    step(models, mesh, optimizer, scheduler, input_ids, mask)
    replicated = torch.cat(
        [e.param.detach().flatten() for e in adapter_params(models) if e.partition_dim is None]
    )
    copies = [torch.empty_like(replicated) for _ in range(mesh.tp)]
    dist.all_gather(copies, replicated, group=mesh.tp_group)
    report["dropout_replicated_equal_over_tp"] = all_true(
        all(torch.equal(copies[0], c) for c in copies)
    )
    return report


def check_dp_extras(mesh: Mesh, hf_dir: str, args, input_ids, mask, counted: int) -> dict:
    report = {}
    models, optimizer, scheduler = trained(lora_model(hf_dir, mesh, args.peft), mesh, True)
    step(models, mesh, optimizer, scheduler, input_ids, mask)
    state = torch.tensor([optimizer_state_numel(optimizer)])
    dist.all_reduce(state, group=mesh.dp_group)
    report["distributed_optimizer_state_is_adapters"] = all_true(state.item() == counted)
    report["distributed_grad_buffer_only_adapters"] = all_true(
        {id(p) for c in models for b in c.buffers for p in b.params}
        == {id(e.param) for e in adapter_params(models)}
    )

    recompute = ModelBuildOptions(recompute=Recompute("full", "uniform", 1))
    models, optimizer, scheduler = trained(
        lora_model(hf_dir, mesh, args.peft, options=recompute), mesh
    )
    step(models, mesh, optimizer, scheduler, input_ids, mask)
    report["full_recompute_grads_vs_peft"] = grad_diff(
        models, mesh, peft_grads(hf_dir, args.peft, input_ids, mask)
    )

    models = lora_model(hf_dir, mesh, None)
    for name, folder in (("bad_rank", args.bad_rank), ("bad_shape", args.bad_shape)):
        report[name] = expect_lora_error(models, mesh, folder)
    report["qv_only"] = expect_lora_error(models, mesh, args.qv_only)
    return report


def expect_lora_error(models, mesh: Mesh, folder: str) -> str:
    try:
        load_peft_adapter(models, mesh, folder)
    except LoraConfigError as error:
        return str(error)
    return "no error"


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("untied", "tied", "peft", "bad-rank", "bad-shape", "qv-only"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--hybrid", help="a Qwen3.5 text model, checked at TP2 with its adapter")
    parser.add_argument("--hybrid-peft")
    parser.add_argument("--out", required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    args.hybrid_layout = False
    results = {}
    for tp, pp, model in LAYOUTS:
        mesh = init_parallel(tp=tp, pp=pp, seed=3)
        # The adapter's shapes are the base config's: one PEFT folder fits both models.
        hf_dir = args.untied if model == "untied" else args.tied
        results[f"tp{tp}-pp{pp}-dp{mesh.dp}"] = check_layout(mesh, hf_dir, args)
        parallel_state.destroy_model_parallel()
    if args.hybrid:
        # Qwen3.5: adapters on the gated attention's q (its gates too), k, v, o in the
        # attention layer, on every layer's MLP, none in the DeltaNet layers.
        mesh = init_parallel(tp=2, pp=1, seed=3)
        hybrid = argparse.Namespace(**{**vars(args), "peft": args.hybrid_peft})
        hybrid.hybrid_layout, hybrid.out = True, str(Path(args.out) / "hybrid")
        results["hybrid-tp2"] = check_layout(mesh, args.hybrid, hybrid)
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
