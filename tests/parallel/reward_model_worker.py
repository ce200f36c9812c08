"""torchrun worker (2 processes) for test_reward_model.py: TP2, PP2 and TP1 x DP2 in one launch.

    reward_model_worker.py QWEN2_RM_DIR LLAMA_RM_DIR QWEN2_LM_DIR OUT_DIR

For each layout (megatron's model-parallel state is rebuilt in between):
  * scores: a Qwen2 and a Llama reward model (HF *ForSequenceClassification, num_labels 1) score
    right-padded rows of several lengths, one of which ends in tokens equal to the pad id,
    through parallel.reward_model.score_sequences (token budget without PP, equal-size
    micro-batches with a filler under PP); they equal HF transformers' scores (fp32, 1e-5);
  * training: a reward model started from a causal LM (fresh score head) takes Bradley-Terry
    steps through parallel.optim.train_step; the first step's loss and gradient norm equal HF
    autograd's on the same weights (exported before the step), and the loss falls;
  * export: the trained model written by save_hf_checkpoint loads with
    AutoModelForSequenceClassification without missing or unexpected keys and gives the same
    scores and pairwise accuracy as Megatron.
Prints numbers from rank 0; exits non-zero on a failed check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from transformers import AutoModelForSequenceClassification

from parallel.convert import save_hf_checkpoint
from parallel.mesh import Mesh, init_parallel
from parallel.optim import build_optimizer, wrap_for_training
from parallel.preference_pairs import TokenizedPairs, pad_sequences
from parallel.reward_model import load_reward_model, score_sequences
from parallel.reward_training import bradley_terry_step, pairwise_accuracy

LAYOUTS = [(2, 1), (1, 2), (1, 1)]  # (tp, pp); 1 x 1 on two processes is DP2
PAD = 0
TOLERANCE = 1e-5


def score_rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    lengths = [9, 4, 12, 7, 12, 5]
    rows = [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths]
    rows[3][-2:] = [PAD, PAD]  # real tokens equal to the pad id: HF scores before them
    return pad_sequences(rows, PAD)


def preference_pairs(vocab: int, count: int = 8) -> TokenizedPairs:
    generator = torch.Generator().manual_seed(11)

    def sequence() -> list[int]:
        length = int(torch.randint(4, 13, (1,), generator=generator))
        return torch.randint(1, vocab, (length,), generator=generator).tolist()

    margins = (torch.rand(count, generator=generator) * 0.5).tolist()
    return TokenizedPairs(
        [sequence() for _ in range(count)], [sequence() for _ in range(count)], margins
    )


def hf_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]


def check_scores(mesh: Mesh, hf_dir: str, input_ids, attention_mask) -> float:
    models = load_reward_model(hf_dir, mesh)
    budget = {"micro_batch_size": 4} if mesh.pp > 1 else {"micro_batch_size": 1, "max_tokens": 24}
    scores = score_sequences(models, mesh, input_ids, attention_mask, **budget).cpu()
    reference = AutoModelForSequenceClassification.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        expected = hf_scores(reference, input_ids, attention_mask)
    diff = (scores - expected).abs().max().item()
    assert diff < TOLERANCE, (hf_dir, diff, scores, expected)
    return diff


def hf_bradley_terry(hf_dir: Path, pairs: TokenizedPairs) -> tuple[float, float, float]:
    """(mean loss, gradient norm, accuracy) of HF transformers on `pairs`."""
    model = AutoModelForSequenceClassification.from_pretrained(hf_dir)
    ids, mask = pad_sequences(pairs.chosen + pairs.rejected, PAD)
    scores = hf_scores(model, ids, mask)
    chosen, rejected = scores[: len(pairs)], scores[len(pairs) :]
    loss = -F.logsigmoid(chosen - rejected - torch.tensor(pairs.margins)).mean()
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    return loss.item(), norm.item(), (chosen > rejected).float().mean().item()


def check_training(mesh: Mesh, lm_dir: str, out_dir: Path, pairs: TokenizedPairs) -> dict:
    layout = f"tp{mesh.tp}_pp{mesh.pp}_dp{mesh.dp}"
    models = load_reward_model(lm_dir, mesh, from_language_model=True, pad_token_id=PAD)
    models = wrap_for_training(models, mesh)
    optimizer, scheduler = build_optimizer(models, lr=3e-3, clip_grad=100.0, total_steps=10)
    initial = out_dir / f"initial_{layout}"
    save_hf_checkpoint(models, mesh, initial, models[0].module.hf_config)
    ref_loss, ref_norm, _ = hf_bradley_terry(initial, pairs)

    mine = pairs.share(mesh)
    options = {"num_pairs": len(pairs), "micro_batch_size": 2}
    if mesh.pp == 1:
        options["max_tokens"] = 30  # token budget: pairs regrouped by length
    steps = [bradley_terry_step(models, mesh, optimizer, scheduler, mine, **options)]
    for _ in range(3):
        steps.append(bradley_terry_step(models, mesh, optimizer, scheduler, mine, **options))
    losses = [step["loss"] for step in steps]
    numbers = {
        "loss_vs_hf": abs(losses[0] - ref_loss),
        "grad_norm_vs_hf": abs(steps[0]["grad_norm"] - ref_norm) / ref_norm,
        "losses": losses,
    }
    assert numbers["loss_vs_hf"] < 1e-5, (numbers, ref_loss)
    assert numbers["grad_norm_vs_hf"] < 1e-4, (numbers, steps[0], ref_norm)
    assert all(a > b for a, b in zip(losses, losses[1:], strict=False)), losses

    exported = out_dir / f"trained_{layout}"
    save_hf_checkpoint(models, mesh, exported, models[0].module.hf_config)
    hf_model, info = AutoModelForSequenceClassification.from_pretrained(
        exported, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids, mask = pad_sequences(pairs.chosen + pairs.rejected, PAD)
    megatron = score_sequences(models, mesh, ids, mask, micro_batch_size=4).cpu()
    with torch.no_grad():
        expected = hf_scores(hf_model.eval(), ids, mask)
    numbers["export_score_diff"] = (megatron - expected).abs().max().item()
    assert numbers["export_score_diff"] < TOLERANCE, numbers
    accuracy = pairwise_accuracy(models, mesh, pairs, micro_batch_size=4)
    _, _, hf_accuracy = hf_bradley_terry(exported, pairs)
    assert accuracy["accuracy"] == hf_accuracy and accuracy["pairs"] == len(pairs), accuracy
    numbers["trained_accuracy"] = accuracy["accuracy"]
    return numbers


def main() -> None:
    qwen2_rm, llama_rm, qwen2_lm, out_dir = sys.argv[1:5]
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(qwen2_rm).vocab_size
    input_ids, attention_mask = score_rows(vocab)
    pairs = preference_pairs(vocab)
    for tp, pp in LAYOUTS:
        mesh = init_parallel(tp=tp, pp=pp, seed=5)
        numbers = {
            "qwen2_score_diff": check_scores(mesh, qwen2_rm, input_ids, attention_mask),
            "llama_score_diff": check_scores(mesh, llama_rm, input_ids, attention_mask),
            **check_training(mesh, qwen2_lm, Path(out_dir), pairs),
        }
        if dist.get_rank() == 0:
            print(f"REWARD_MODEL tp={tp} pp={pp} dp={mesh.dp}: {numbers}", flush=True)
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        print("REWARD_MODEL_WORKER_OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
