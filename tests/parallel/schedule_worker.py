"""torchrun worker (2 processes): parallel.schedule against HF transformers, several layouts.

    schedule_worker.py POLICY_HF_DIR CRITIC_HF_DIR

For each layout (TP2, PP2, PP2 x VPP2), in one launch (megatron's model-parallel state is
rebuilt between layouts, the default process group is kept):
  * forward_only log-probs and entropy at temperature 0.7, micro-batches of different
    lengths, equal HF's log_softmax(logits / 0.7) on real tokens, on every rank;
  * forward_log_probs (batch not divisible by the micro-batch size) equals HF;
  * forward_top_log_probs's top 5 tokens per position, and the log-probs of given token ids
    (``scored_ids``, the forward of distillation's top-k loss), equal HF's top 5;
  * gradients after forward_backward equal the gradient of the SUM over micro-batches of
    the loss in HF (final norm on the last stage, embedding rows on the first stage);
  * critic values equal HF's Qwen2ForTokenClassification(num_labels=1) scores.
Prints measured max differences from rank 0; exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from transformers import AutoConfig, Qwen2ForCausalLM, Qwen2ForTokenClassification

from parallel.convert import load_hf_weights
from parallel.forward_passes import forward_log_probs, forward_top_log_probs
from parallel.mesh import Mesh, init_parallel
from parallel.model import build_model
from parallel.schedule import forward_backward
from parallel.step_types import LossReport, MicroBatch, ModelOutputs
from rlcli.process_lifetime import exit_skipping_teardown

TEMPERATURE = 0.7
TOP_K = 5
LAYOUTS = [(2, 1, None), (1, 2, None), (1, 2, 2)]


def make_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """6 right-padded sequences of length 12 with 12, 10, 7, 12, 5, 9 real tokens."""
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, vocab_size, (6, 12), generator=generator)
    attention_mask = torch.zeros(6, 12, dtype=torch.long)
    for row, length in enumerate([12, 10, 7, 12, 5, 9]):
        attention_mask[row, :length] = 1
    return input_ids * attention_mask, attention_mask


def micro_batches_of(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[MicroBatch]:
    """Three micro-batches of 2 rows, cut to different lengths (12, 12, 9 columns)."""
    cuts = [(0, 2, 12), (2, 4, 12), (4, 6, 9)]
    return [
        MicroBatch(input_ids=input_ids[a:b, :s], attention_mask=attention_mask[a:b, :s])
        for a, b, s in cuts
    ]


def policy_loss(outputs: ModelOutputs, micro_batch: MicroBatch) -> tuple[torch.Tensor, LossReport]:
    """A summed (not averaged) per-token loss, so the sum over micro-batches is well defined."""
    mask = micro_batch.attention_mask[:, 1:].float()
    loss = -(outputs.log_probs * mask).sum() - 0.1 * (outputs.entropy * mask).sum()
    return loss, LossReport({"loss": loss.item(), "tokens": mask.sum().item()})


def hf_policy_reference(hf_dir: str, input_ids, attention_mask):
    """log-probs, entropy [6, 11], the gradients of the summed policy loss and the top
    ``TOP_K`` log-probs and ids [6, 11, TOP_K], from HF."""
    model = Qwen2ForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    logits = model(input_ids=input_ids).logits / TEMPERATURE
    log_p = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    log_probs = log_p.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    top = log_p.detach().float().topk(TOP_K, dim=-1)
    mask = attention_mask[:, 1:].double()
    loss = -(log_probs * mask).sum() - 0.1 * (entropy * mask).sum()
    loss.backward()
    grads = {
        "norm": model.model.norm.weight.grad.clone(),
        "embedding": model.model.embed_tokens.weight.grad.clone(),
    }
    return log_probs.detach().float(), entropy.detach().float(), grads, top


def hf_values(hf_dir: str, input_ids) -> torch.Tensor:
    model = Qwen2ForTokenClassification.from_pretrained(hf_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=input_ids).logits[..., 0]


def max_masked_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return ((a - b).abs() * mask).max().item()


def check_layout(mesh: Mesh, hf_config, policy_dir, critic_dir, batch, refs) -> dict[str, float]:
    input_ids, attention_mask = batch
    ref_lp, ref_entropy, ref_grads, ref_top, ref_values = refs
    label_mask = attention_mask[:, 1:].float()
    diffs = {}

    models = build_model(hf_config, mesh)
    load_hf_weights(models, mesh, policy_dir)
    micro_batches = micro_batches_of(input_ids, attention_mask)

    # Forward only: every rank of the pipeline receives the outputs.
    results = forward_backward(
        models,
        mesh,
        micro_batches,
        policy_loss,
        forward_only=True,
        temperature=TEMPERATURE,
        compute_entropy=True,
    )
    lp_diff, entropy_diff = 0.0, 0.0
    for result, (a, b, s) in zip(results, [(0, 2, 12), (2, 4, 12), (4, 6, 9)], strict=True):
        assert result.outputs.log_probs.shape == (2, s - 1), result.outputs.log_probs.shape
        lp_diff = max(
            lp_diff,
            max_masked_diff(
                result.outputs.log_probs, ref_lp[a:b, : s - 1], label_mask[a:b, : s - 1]
            ),
        )
        entropy_diff = max(
            entropy_diff,
            max_masked_diff(
                result.outputs.entropy, ref_entropy[a:b, : s - 1], label_mask[a:b, : s - 1]
            ),
        )
        assert abs(result.report.metrics["tokens"] - label_mask[a:b, : s - 1].sum().item()) == 0
    diffs["log_probs"], diffs["entropy"] = lp_diff, entropy_diff

    whole = forward_log_probs(models, mesh, input_ids[:5], attention_mask[:5], 2, TEMPERATURE)
    assert whole.shape == (5, 11)
    diffs["forward_log_probs"] = max_masked_diff(whole, ref_lp[:5], label_mask[:5])
    # A single micro-batch: the interleaved schedule needs filler micro-batches.
    single = forward_log_probs(models, mesh, input_ids[:2], attention_mask[:2], 2, TEMPERATURE)
    diffs["forward_log_probs"] = max(
        diffs["forward_log_probs"], max_masked_diff(single, ref_lp[:2], label_mask[:2])
    )

    # The likeliest tokens of every position, and the log-probs of given ids (HF's top 5, one
    # column of padding: the last position scores nothing).
    whole, top_lp, top_ids = forward_top_log_probs(
        models, mesh, input_ids[:5], attention_mask[:5], 2, TOP_K, TEMPERATURE
    )
    real = label_mask[:5].bool()
    assert top_ids.shape == (5, 11, TOP_K) and torch.equal(top_ids[real], ref_top.indices[:5][real])
    diffs["top_log_probs"] = (top_lp - ref_top.values[:5])[real].abs().max().item()
    scored = [
        MicroBatch(
            input_ids=mb.input_ids,
            attention_mask=mb.attention_mask,
            scored_ids=torch.nn.functional.pad(ref_top.indices[a:b, : s - 1], (0, 0, 0, 1)),
        )
        for mb, (a, b, s) in zip(micro_batches, [(0, 2, 12), (2, 4, 12), (4, 6, 9)], strict=True)
    ]
    results = forward_backward(
        models, mesh, scored, None, forward_only=True, temperature=TEMPERATURE
    )
    diffs["scored_log_probs"] = max(
        max_masked_diff(
            result.outputs.scored_log_probs,
            ref_top.values[a:b, : s - 1],
            label_mask[a:b, : s - 1, None],
        )
        for result, (a, b, s) in zip(results, [(0, 2, 12), (2, 4, 12), (4, 6, 9)], strict=True)
    )

    # Training: the gradient is that of the SUM of the micro-batch losses (not their mean).
    forward_backward(
        models,
        mesh,
        micro_batches,
        policy_loss,
        forward_only=False,
        temperature=TEMPERATURE,
        compute_entropy=True,
    )
    if mesh.is_last_stage:
        norm = models[-1].decoder.final_layernorm.weight.grad
        diffs["grad_norm_weight"] = (norm - ref_grads["norm"]).abs().max().item()
        assert diffs["grad_norm_weight"] < 1e-4 * ref_grads["norm"].abs().max().item(), diffs
    if mesh.is_first_stage:
        embedding = models[0].embedding.word_embeddings.weight.grad
        rows = embedding.shape[0]
        start = mesh.tp_rank * rows
        reference = torch.zeros_like(embedding)
        valid = min(rows, hf_config.vocab_size - start)
        reference[:valid] = ref_grads["embedding"][start : start + valid]
        diffs["grad_embedding"] = (embedding - reference).abs().max().item()
        assert diffs["grad_embedding"] < 1e-4 * reference.abs().max().item(), diffs

    critics = build_model(hf_config, mesh, critic=True)
    load_hf_weights(critics, mesh, critic_dir)
    values = forward_backward(critics, mesh, micro_batches, None, forward_only=True)
    value_diff = 0.0
    for result, (a, b, s) in zip(values, [(0, 2, 12), (2, 4, 12), (4, 6, 9)], strict=True):
        assert result.outputs.values.shape == (2, s)
        value_diff = max(
            value_diff,
            max_masked_diff(
                result.outputs.values, ref_values[a:b, :s], attention_mask[a:b, :s].float()
            ),
        )
    diffs["values"] = value_diff

    for name in (
        "log_probs", "entropy", "forward_log_probs", "top_log_probs", "scored_log_probs", "values"
    ):  # fmt: skip
        assert diffs[name] < 2e-4, (name, diffs)
    return diffs


def main() -> None:
    policy_dir, critic_dir = sys.argv[1], sys.argv[2]
    hf_config = AutoConfig.from_pretrained(policy_dir)
    batch = make_batch(hf_config.vocab_size)
    refs = (*hf_policy_reference(policy_dir, *batch), hf_values(critic_dir, batch[0]))
    for tp, pp, vpp in LAYOUTS:
        mesh = init_parallel(tp=tp, pp=pp, vpp=vpp, seed=5)
        diffs = check_layout(mesh, hf_config, policy_dir, critic_dir, batch, refs)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, diffs)
        if dist.get_rank() == 0:
            merged = {
                k: max(d.get(k, 0.0) for d in gathered) for k in sorted(set().union(*gathered))
            }
            print(f"SCHEDULE_DIFFS tp={tp} pp={pp} vpp={vpp}: {merged}", flush=True)
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        print("SCHEDULE_WORKER_OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
