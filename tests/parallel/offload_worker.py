"""torchrun worker: parallel.offload round trips, activation recomputation, and the plan's byte
counts against real megatron models.

    offload_worker.py HF_DIR

With 1 process: TP1 (fp32 and bf16). With 2 processes: TP2, PP2 and DP2 with the distributed
optimizer (fp32 and bf16). For each case:
  * offload -> onload of params, grads and optimizer state frees the device storages (0 bytes
    while offloaded) and leaves every tensor bit-identical, through the views megatron uses
    (param.data, param.main_grad, the optimizer's master weights and Adam moments);
  * a following optimizer step equals, bit for bit, the same step taken without offload;
  * discard_grads frees the gradient buffers without copying and onload zeroes them;
  * parallel.memory_terms' parameter, gradient and optimizer counts equal the real model's.
And full / selective recomputation give the same loss and gradients as none (fp32).
Prints "OFFLOAD_WORKER_OK" from rank 0; exits non-zero on a failed check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from transformers import AutoConfig

from parallel.convert import load_hf_weights
from parallel.memory_terms import (
    TrainedModel,
    grad_numel_bytes,
    layer_activation_bytes,
    optimizer_state_numel,
)
from parallel.mesh import Mesh, init_parallel
from parallel.model import build_model
from parallel.model_options import ModelBuildOptions, Recompute
from parallel.model_shapes import ModelShape, stage_params
from parallel.offload import Offloader
from parallel.optim import (
    OptimizerSettings,
    build_optimizer,
    sub_optimizers,
    train_step,
    wrap_for_training,
)
from rlcli.process_lifetime import exit_skipping_teardown
from tests.parallel.optim_worker import make_batch, mean_nll_loss, split

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def fresh(mesh: Mesh, hf_config, hf_dir: str, dtype: str, distributed: bool, recompute=None):
    torch.manual_seed(5)
    options = ModelBuildOptions(recompute=recompute or Recompute())
    models = build_model(hf_config, mesh, dtype=DTYPES[dtype], options=options)
    load_hf_weights(models, mesh, hf_dir)
    models = wrap_for_training(models, mesh, use_distributed_optimizer=distributed)
    optimizer, scheduler = build_optimizer(
        models,
        OptimizerSettings(
            lr=1e-3, clip_grad=1.0, use_distributed_optimizer=distributed, total_steps=10
        ),
    )
    return models, optimizer, scheduler


def snapshot(models, optimizer) -> list[torch.Tensor]:
    """Every tensor the offloader must restore, read through the views training uses."""
    out = []
    for chunk in models:
        for p in chunk.module.parameters():
            out += [p.data.clone(), p.main_grad.clone()]
    subs = sub_optimizers(optimizer)
    for sub in subs:
        for group in sub.optimizer.param_groups:
            for p in group["params"]:
                out.append(p.data.clone())
                for value in sub.optimizer.state[p].values():
                    if isinstance(value, torch.Tensor):
                        out.append(value.clone())
    return out


def bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def batch_for(mesh: Mesh, vocab: int):
    input_ids, attention_mask = make_batch(vocab)
    rows = input_ids.shape[0] // mesh.dp
    mine = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
    loss_fn = mean_nll_loss(attention_mask[:, 1:].sum().item(), mesh.dp)
    return split(input_ids[mine], attention_mask[mine], 2), loss_fn


def device_bytes(offloader: Offloader, kind: str) -> int:
    """Bytes ``kind`` holds on the device now (0 while offloaded)."""
    if offloader.is_offloaded(kind):
        return 0
    return sum(storage.nbytes() for storage in offloader._storages(kind))


def check_round_trip(mesh, hf_config, hf_dir, dtype, distributed) -> dict:
    micro, loss_fn = batch_for(mesh, hf_config.vocab_size)
    models, optimizer, scheduler = fresh(mesh, hf_config, hf_dir, dtype, distributed)
    train_step(models, mesh, optimizer, scheduler, micro, loss_fn)  # Adam state now exists
    before = snapshot(models, optimizer)
    offloader = Offloader(models, optimizer)
    on_device = {kind: device_bytes(offloader, kind) for kind in ("params", "grads", "optimizer")}
    stats = offloader.offload(params=True, grads=True, optimizer=True)
    assert stats.bytes == sum(on_device.values()), (stats, on_device)
    for kind in on_device:
        assert device_bytes(offloader, kind) == 0
    freed = [p.untyped_storage().nbytes() for c in models for p in c.module.parameters()]
    assert set(freed) == {0}, "parameters still hold device memory while offloaded"
    back = offloader.onload(params=True, grads=True, optimizer=True)
    assert back.bytes == stats.bytes
    assert bit_equal(before, snapshot(models, optimizer)), "round trip changed a tensor"
    train_step(models, mesh, optimizer, scheduler, micro, loss_fn)
    after_offload = [p.data.clone() for c in models for p in c.module.parameters()]

    # discard_grads: nothing copied for the grads; they come back zero
    offloader.offload(params=True, grads=True, optimizer=True, discard_grads=True)
    offloader.onload(params=True)
    offloader.onload(grads=True, optimizer=True)
    grads = [p.main_grad for c in models for p in c.module.parameters()]
    assert all(int(g.count_nonzero()) == 0 for g in grads)

    models2, optimizer2, scheduler2 = fresh(mesh, hf_config, hf_dir, dtype, distributed)
    for _ in range(2):
        train_step(models2, mesh, optimizer2, scheduler2, micro, loss_fn)
    plain = [p.data.clone() for c in models2 for p in c.module.parameters()]
    assert bit_equal(after_offload, plain), "a step after offload differs from one without"
    return {"offload_bytes": stats.bytes, **{f"{k}_bytes": v for k, v in on_device.items()}}


def check_reserve(mesh, hf_config, hf_dir, dtype, distributed) -> dict:
    """Host buffers reserved before the first step (no Adam state yet) are large enough for the
    offloads after it: those allocate nothing."""
    micro, loss_fn = batch_for(mesh, hf_config.vocab_size)
    models, optimizer, scheduler = fresh(mesh, hf_config, hf_dir, dtype, distributed)
    offloader = Offloader(models, optimizer)
    reserved = offloader.reserve(params=True, grads=True, optimizer=True)
    assert reserved.allocated_bytes > 0 and reserved.bytes == 0, reserved
    assert offloader.reserve(params=True, grads=True).allocated_bytes == 0  # already there
    train_step(models, mesh, optimizer, scheduler, micro, loss_fn)  # Adam's moments appear
    first = offloader.offload(params=True, grads=True, optimizer=True)
    assert first.allocated_bytes == 0 and 0 < first.bytes <= reserved.allocated_bytes, first
    offloader.onload(params=True, grads=True, optimizer=True)
    again = offloader.offload(params=True, grads=True, optimizer=True)
    assert again.allocated_bytes == 0 and again.bytes == first.bytes, again
    offloader.onload(params=True, grads=True, optimizer=True)
    return {"reserved_bytes": reserved.allocated_bytes, "first_offload_bytes": first.bytes}


def check_plan_counts(mesh, hf_config, hf_dir, dtype, distributed) -> dict:
    """memory_terms' counts for this rank's stage equal the real model's."""
    micro, loss_fn = batch_for(mesh, hf_config.vocab_size)
    models, optimizer, scheduler = fresh(mesh, hf_config, hf_dir, dtype, distributed)
    train_step(models, mesh, optimizer, scheduler, micro, loss_fn)
    shape = ModelShape.from_hf_config(json.loads((Path(hf_dir) / "config.json").read_text()))
    planned = stage_params(shape, tp=mesh.tp, pp=mesh.pp, pp_rank=mesh.pp_rank)
    params = sum(p.numel() for c in models for p in c.module.parameters())
    assert params == planned, (params, planned)
    grad_buffer = sum(
        b.numel_unpadded * b.grad_data.element_size() for c in models for b in c.buffers
    )
    assert grad_buffer == grad_numel_bytes(planned, dtype=dtype), (grad_buffer, planned)
    subs = sub_optimizers(optimizer)
    masters = [p for sub in subs for group in sub.optimizer.param_groups for p in group["params"]]
    moments = [
        v
        for sub in subs
        for p in masters
        if p in sub.optimizer.state
        for v in sub.optimizer.state[p].values()
        if torch.is_tensor(v) and v.dim() > 0
    ]
    assert all(t.dtype == torch.float32 for t in masters + moments)
    # an fp32 model's optimizer steps the model's own parameters: no separate master weights
    state = sum(t.numel() for t in moments + (masters if dtype != "float32" else []))
    total_state = torch.tensor(state)
    if distributed:  # each rank holds a shard of the padded buffer: exact over the DP group
        # each rank's shard is 1/dp of the padded buffer; padding is not state
        padded = sum(b.numel for c in models for b in c.buffers)
        expected_here = optimizer_state_numel(padded, dtype=dtype, dp=mesh.dp, distributed=True)
        assert state <= expected_here, (state, expected_here)
        dist.all_reduce(total_state, group=mesh.dp_group)
    want = optimizer_state_numel(planned, dtype=dtype)
    assert int(total_state) == want, (int(total_state), want)
    return {"params": params, "optimizer_numel": int(total_state)}


def check_recompute(mesh, hf_config, hf_dir) -> dict:
    micro, loss_fn = batch_for(mesh, hf_config.vocab_size)
    results = {}
    for mode in ("none", "selective", "full"):
        recompute = Recompute(mode, "uniform", 1)
        models, optimizer, scheduler = fresh(mesh, hf_config, hf_dir, "float32", False, recompute)
        calls = []  # core attention runs again in backward when it is recomputed
        for chunk in models:
            for layer in chunk.module.decoder.layers:
                layer.self_attention.core_attention.register_forward_hook(
                    lambda *_, calls=calls: calls.append(1)
                )
        out = train_step(models, mesh, optimizer, scheduler, micro, loss_fn)
        runs_per_layer = len(calls) / (
            len(micro) * sum(len(c.module.decoder.layers) for c in models)
        )
        assert runs_per_layer == (1 if mode == "none" else 2), (mode, runs_per_layer)
        grads = [p.main_grad.clone() for c in models for p in c.module.parameters()]
        nll = sum(float(r.metrics["nll_sum"]) for r in out.reports)
        results[mode] = (nll, out.grad_norm, grads)
    numbers = {}
    for mode in ("selective", "full"):
        loss_diff = abs(results[mode][0] - results["none"][0])
        grad_diff = max(
            (a - b).abs().max().item()
            for a, b in zip(results[mode][2], results["none"][2], strict=True)
        )
        numbers[f"{mode}_loss_diff"], numbers[f"{mode}_grad_diff"] = loss_diff, grad_diff
        assert loss_diff <= 1e-5 * abs(results["none"][0]) and grad_diff < 1e-6, numbers
    return numbers


def measured_layer_activations(models, input_ids: torch.Tensor) -> int:
    """Bytes the decoder layers save for backward in one forward (distinct storages, parameters
    excluded), read with torch.autograd.graph.saved_tensors_hooks."""
    params = {p.untyped_storage().data_ptr() for c in models for p in c.parameters()}
    where, seen = ["outside"], {}
    for chunk in models:
        for layer in chunk.decoder.layers:
            layer.register_forward_pre_hook(lambda *_: where.__setitem__(0, "layer"))
            layer.register_forward_hook(lambda *_: where.__setitem__(0, "outside"))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage.nbytes() if where[0] == "layer" else 0
        return tensor

    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        models[0](input_ids, positions, attention_mask=None)
    return sum(seen.values())


def check_activation_estimate(mesh, hf_config, hf_dir) -> dict:
    """memory_terms' per-layer activation bytes (local layers, both core attentions, fp32 and
    bf16, with and without selective recomputation) against the saved tensors."""
    shape = ModelShape.from_hf_config(json.loads((Path(hf_dir) / "config.json").read_text()))
    input_ids = torch.randint(0, hf_config.vocab_size, (2, 48), generator=torch.Generator())
    numbers = {}
    for attention in ("local", "sdpa"):
        for dtype in ("float32", "bfloat16"):
            for mode in ("none", "selective"):
                torch.manual_seed(5)
                models = build_model(
                    hf_config,
                    mesh,
                    dtype=getattr(torch, dtype),
                    options=ModelBuildOptions(
                        attention_backend=attention, recompute=Recompute(mode)
                    ),
                )
                measured = measured_layer_activations(models, input_ids)
                planned = TrainedModel(
                    shape,
                    dtype=dtype,
                    tp=mesh.tp,
                    micro_batch_size=2,
                    seq_len=48,
                    attention=attention,
                    device="cpu",  # the composite RMSNorm; CUDA's fused kernel keeps less
                )
                estimate = shape.layers * layer_activation_bytes(
                    planned, recompute_attention=mode != "none"
                )
                key = f"{attention}_{dtype}_{mode}_measured_over_plan"
                numbers[key] = round(measured / estimate, 3)
                assert abs(measured / estimate - 1) < 0.10, numbers
    return numbers


def main() -> None:
    hf_dir = sys.argv[1]
    hf_config = AutoConfig.from_pretrained(hf_dir)
    world = int(__import__("os").environ["WORLD_SIZE"])
    layouts = [(1, 1)] if world == 1 else [(2, 1), (1, 2), (1, 1)]
    for tp, pp in layouts:
        mesh = init_parallel(tp=tp, pp=pp, seed=5)
        distributed_options = [False] if mesh.dp == 1 else [True]
        for dtype in ("float32", "bfloat16"):
            for distributed in distributed_options:
                numbers = check_round_trip(mesh, hf_config, hf_dir, dtype, distributed)
                numbers.update(check_reserve(mesh, hf_config, hf_dir, dtype, distributed))
                numbers.update(check_plan_counts(mesh, hf_config, hf_dir, dtype, distributed))
                if dist.get_rank() == 0:
                    print(
                        f"OFFLOAD tp={tp} pp={pp} dp={mesh.dp} {dtype} dist_opt={distributed}:"
                        f" {numbers}",
                        flush=True,
                    )
        if pp == 1:
            numbers = check_recompute(mesh, hf_config, hf_dir)
            numbers.update(check_activation_estimate(mesh, hf_config, hf_dir))
            if dist.get_rank() == 0:
                print(f"RECOMPUTE tp={tp} dp={mesh.dp}: {numbers}", flush=True)
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        print("OFFLOAD_WORKER_OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
