"""torchrun worker (2 processes): parallel.optim at TP2, PP2, PP2 x VPP2 and DP2, one launch.

    optim_worker.py HF_DIR

For each layout (megatron's model-parallel state is rebuilt in between):
  * the first step's gradient norm equals HF's gradient norm of the mean token NLL over the
    global batch (so DP averaging and the loss scaling are what the docs say);
  * 3 train_steps on a fixed batch: the loss falls every step;
  * DP2: both replicas hold bit-identical weights after the steps;
  * gradient accumulation is exact: one micro-batch of 4 rows vs two of 2 give the same
    gradients and the same weights after one step;
  * overlap_grad_reduce takes the same step;
  * DP2: the distributed optimizer takes the same step as the plain one.
Prints measured numbers from rank 0; exits non-zero on a failed check.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from transformers import AutoConfig, Qwen2ForCausalLM

from parallel.convert import load_hf_weights
from parallel.mesh import Mesh, init_parallel
from parallel.model import build_model
from parallel.optim import (
    OptimizerSettings,
    build_optimizer,
    sub_optimizers,
    train_step,
    wrap_for_training,
)
from parallel.step_types import LossReport, MicroBatch, ModelOutputs
from rlcli.process_lifetime import exit_skipping_teardown

LAYOUTS = [(2, 1, None), (1, 2, None), (1, 2, 2), (1, 1, None)]  # (tp, pp, vpp); 1x1 is DP2
ROWS, SEQ = 8, 10


def make_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    input_ids = torch.randint(0, vocab_size, (ROWS, SEQ), generator=generator)
    attention_mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    attention_mask[1, 7:] = attention_mask[4, 5:] = attention_mask[6, 8:] = 0
    return input_ids * attention_mask, attention_mask


def mean_nll_loss(global_tokens: float, dp: int):
    """Loss whose DP-averaged, micro-batch-summed gradient is that of the global mean NLL."""

    def loss_fn(outputs: ModelOutputs, micro_batch: MicroBatch) -> tuple[torch.Tensor, LossReport]:
        mask = micro_batch.attention_mask[:, 1:].float()
        nll = -(outputs.log_probs * mask).sum()
        return nll * dp / global_tokens, LossReport({"nll_sum": nll.item()})

    return loss_fn


def hf_grad_norm(hf_dir: str, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> float:
    model = Qwen2ForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    log_p = torch.log_softmax(model(input_ids=input_ids).logits[:, :-1], dim=-1)
    picked = log_p.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    mask = attention_mask[:, 1:].float()
    (-(picked * mask).sum() / mask.sum()).backward()
    return torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
    ).item()


def fresh_training_state(
    mesh: Mesh,
    hf_config,
    hf_dir: str,
    distributed: bool = False,
    overlap: bool = False,
    clip_grad: float = 1.0,
):
    models = build_model(hf_config, mesh)
    load_hf_weights(models, mesh, hf_dir)
    models = wrap_for_training(
        models, mesh, use_distributed_optimizer=distributed, overlap_grad_reduce=overlap
    )
    optimizer, scheduler = build_optimizer(
        models,
        OptimizerSettings(
            lr=2e-3,
            min_lr=1e-4,
            clip_grad=clip_grad,
            use_distributed_optimizer=distributed,
            warmup_steps=0,
            total_steps=10,
            decay_style="linear",
        ),
    )
    return models, optimizer, scheduler


def split(input_ids, attention_mask, size: int) -> list[MicroBatch]:
    return [
        MicroBatch(input_ids=ids, attention_mask=mask)
        for ids, mask in zip(input_ids.split(size), attention_mask.split(size), strict=True)
    ]


def local_weights(models) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in models for p in chunk.parameters()]


def local_grads(models) -> list[torch.Tensor]:
    return [p.main_grad.detach().clone() for chunk in models for p in chunk.parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def check_layout(mesh: Mesh, hf_config, hf_dir: str, batch, ref_grad_norm) -> dict[str, float]:
    input_ids, attention_mask = batch
    global_tokens = attention_mask[:, 1:].sum().item()
    rows = ROWS // mesh.dp
    mine = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
    ids, mask = input_ids[mine], attention_mask[mine]
    loss_fn = mean_nll_loss(global_tokens, mesh.dp)
    numbers: dict[str, float] = {}

    models, optimizer, scheduler = fresh_training_state(mesh, hf_config, hf_dir)
    losses, lrs = [], []
    for step in range(4):
        result = train_step(models, mesh, optimizer, scheduler, split(ids, mask, 2), loss_fn)
        assert not result.skipped
        nll = torch.tensor(sum(r.metrics["nll_sum"] for r in result.reports))
        dist.all_reduce(nll, group=mesh.dp_group)
        losses.append(nll.item() / global_tokens)
        lrs.append(result.lr)
        if step == 0:
            numbers["grad_norm_vs_hf"] = abs(result.grad_norm - ref_grad_norm)
            assert numbers["grad_norm_vs_hf"] < 1e-4 * ref_grad_norm, (result, ref_grad_norm)
    numbers.update({f"loss{i}": loss for i, loss in enumerate(losses)})
    assert all(a > b for a, b in zip(losses, losses[1:], strict=False)), losses
    assert lrs[0] == 2e-3 and lrs[1] < lrs[0], lrs  # linear decay from the first step

    if mesh.dp > 1:
        weights = local_weights(models)
        other = [torch.empty_like(w) for w in weights]
        peer = 1 - mesh.dp_rank
        for mine_w, theirs in zip(weights, other, strict=True):
            ops = [
                dist.P2POp(dist.isend, mine_w, dist.get_global_rank(mesh.dp_group, peer)),
                dist.P2POp(dist.irecv, theirs, dist.get_global_rank(mesh.dp_group, peer)),
            ]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        numbers["dp_replica_weight_diff"] = max_diff(weights, other)
        assert numbers["dp_replica_weight_diff"] == 0.0

    # Gradient accumulation: 1 x 4 rows vs 2 x 2 rows, from the same starting weights.
    after = {}
    for size in (4, 2):
        models, optimizer, scheduler = fresh_training_state(mesh, hf_config, hf_dir)
        train_step(models, mesh, optimizer, scheduler, split(ids[:4], mask[:4], size), loss_fn)
        after[size] = (local_grads(models), local_weights(models))
    numbers["accumulation_grad_diff"] = max_diff(after[4][0], after[2][0])
    numbers["accumulation_weight_diff"] = max_diff(after[4][1], after[2][1])
    assert numbers["accumulation_grad_diff"] < 1e-7, numbers
    # Adam's first step is lr * g / (|g| + eps), whose slope in g is at most 1 / eps: gradients
    # that differ by float rounding (d) near eps (1e-8) may move weights by up to lr * d / eps.
    # Gradients and weights are clipped alike (clip_grad=1.0), so that bound holds per element.
    lr, eps = 2e-3, 1e-8
    bound = lr * numbers["accumulation_grad_diff"] / eps + 1e-7
    assert numbers["accumulation_weight_diff"] <= bound, (numbers, bound)

    # The optimizer's update against torch's reference AdamW loop (foreach and fused off, so the
    # check holds whichever Adam runs: TE's, Apex's or torch's fused CPU kernel) on the same weights
    # and reduced gradients; no clipping, so the gradients it saw are the ones left in the buffers.
    models, optimizer, scheduler = fresh_training_state(mesh, hf_config, hf_dir, clip_grad=0.0)
    if not torch.cuda.is_available():  # on CPU, build_optimizer picks torch's fused kernel
        for sub_optimizer in sub_optimizers(optimizer):
            assert all(group["fused"] for group in sub_optimizer.optimizer.param_groups)
    reference_params = [torch.nn.Parameter(w) for w in local_weights(models)]
    reference = torch.optim.AdamW(reference_params, weight_decay=0.0, foreach=False, fused=False)
    for _ in range(2):  # the second step also compares the moments carried from the first
        result = train_step(
            models, mesh, optimizer, scheduler, split(ids[:4], mask[:4], 2), loss_fn
        )
        reference.param_groups[0]["lr"] = result.lr
        for param, grad in zip(reference_params, local_grads(models), strict=True):
            param.grad = grad
        reference.step()
    reference_weights = [p.detach() for p in reference_params]
    numbers["adam_vs_torch_reference_loop"] = max_diff(local_weights(models), reference_weights)
    assert numbers["adam_vs_torch_reference_loop"] < 1e-6, numbers

    # Gradient reduction overlapped with backward (bucketed, started by the schedule).
    models, optimizer, scheduler = fresh_training_state(mesh, hf_config, hf_dir, overlap=True)
    train_step(models, mesh, optimizer, scheduler, split(ids[:4], mask[:4], 2), loss_fn)
    numbers["overlap_grad_reduce_weight_diff"] = max_diff(local_weights(models), after[2][1])
    assert numbers["overlap_grad_reduce_weight_diff"] < 1e-5, numbers

    if mesh.dp > 1:
        models, optimizer, scheduler = fresh_training_state(mesh, hf_config, hf_dir, True)
        train_step(models, mesh, optimizer, scheduler, split(ids[:4], mask[:4], 2), loss_fn)
        numbers["distributed_optimizer_weight_diff"] = max_diff(local_weights(models), after[2][1])
        assert numbers["distributed_optimizer_weight_diff"] < 1e-5, numbers
    return numbers


def main() -> None:
    hf_dir = sys.argv[1]
    hf_config = AutoConfig.from_pretrained(hf_dir)
    batch = make_batch(hf_config.vocab_size)
    ref_grad_norm = hf_grad_norm(hf_dir, *batch)
    for tp, pp, vpp in LAYOUTS:
        mesh = init_parallel(tp=tp, pp=pp, vpp=vpp, seed=5)
        numbers = check_layout(mesh, hf_config, hf_dir, batch, ref_grad_norm)
        if dist.get_rank() == 0:
            print(f"OPTIM tp={tp} pp={pp} vpp={vpp} dp={mesh.dp}: {numbers}", flush=True)
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        print(f"OPTIM hf_grad_norm={ref_grad_norm}", flush=True)
        print("OPTIM_WORKER_OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
