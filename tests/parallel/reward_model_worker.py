"""torchrun worker (2 processes) for test_reward_model.py: TP2, PP2 and TP1 x DP2 in one launch.

    reward_model_worker.py QWEN2_RM_DIR LLAMA_RM_DIR QWEN2_LM_DIR OUT_DIR

QWEN2_RM_DIR holds a tokenizer with a chat template; LLAMA_RM_DIR holds the policy's tokenizer
(no template), which the policy samples below are written with.

For each layout (megatron's model-parallel state is rebuilt in between):
  * scores: a Qwen2 and a Llama reward model (HF *ForSequenceClassification, num_labels 1) score
    right-padded rows of several lengths, one of which ends in tokens equal to the pad id,
    through parallel.reward_model.score_sequences (token budget without PP, equal-size
    micro-batches with a filler under PP), padded and packed (SDPA, one row of whole sequences
    per micro-batch); they equal HF transformers' scores (fp32, 1e-5);
  * training: a reward model started from a causal LM (fresh score head) takes Bradley-Terry
    steps through parallel.optim.train_step; the first step's loss and gradient norm equal HF
    autograd's on the same weights (exported before the step), and the loss falls;
  * export: the trained model written by save_hf_checkpoint loads with
    AutoModelForSequenceClassification without missing or unexpected keys and gives the same
    scores and pairwise accuracy as Megatron;
  * the RL step's path: policy samples (some cut at the length limit) scored by
    rlcli.reward_models.reward_model.reward_model_scores with the trainer's reward model
    (TrainedModel(head=ScoreHead()), micro-batched by rows under PP, by a token budget otherwise;
    the Qwen2 RM's micro-batches packed),
    through the policy's own tokenizer (the Llama RM) and through the reward model's tokenizer
    and chat template (the Qwen2 RM), equal HF transformers' scores of the same inputs (1e-5) on
    every rank; and the rank's parameter count is what parallel.model_shapes plans for a score
    head (no bias).
Prints numbers from rank 0; exits non-zero on a failed check.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from transformers import AutoModelForSequenceClassification

from parallel.convert import save_hf_checkpoint
from parallel.mesh import Mesh, init_parallel
from parallel.model_options import ModelBuildOptions
from parallel.optim import OptimizerSettings, build_optimizer, train_step, wrap_for_training
from parallel.preference_pairs import TokenizedPairs, pad_sequences
from parallel.reward_model import load_reward_model, score_sequences
from parallel.reward_training import bradley_terry_step, pairwise_accuracy
from rlcli.process_lifetime import exit_skipping_teardown

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
    # Packed: each micro-batch one row of whole sequences (SDPA varlen), no padding computed.
    packed_models = load_reward_model(
        hf_dir, mesh, options=ModelBuildOptions(attention_backend="sdpa", pack_sequences=True)
    )
    rows_seen = []  # the rows of each forward's input_ids: 1 when the micro-batch ran packed
    hooks = [
        chunk.register_forward_pre_hook(lambda _, args: rows_seen.append(args[0].shape[0]))
        for chunk in packed_models
    ]
    packed = score_sequences(packed_models, mesh, input_ids, attention_mask, pack=True, **budget)
    for hook in hooks:
        hook.remove()
    assert rows_seen and set(rows_seen) == {1}, rows_seen
    packed_diff = (packed.cpu() - expected).abs().max().item()
    assert packed_diff < TOLERANCE, (hf_dir, "packed", packed_diff, packed, expected)
    return max(diff, packed_diff)


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
    optimizer, scheduler = build_optimizer(
        models, OptimizerSettings(lr=3e-3, clip_grad=100.0, total_steps=10)
    )
    initial = out_dir / f"initial_{layout}"
    save_hf_checkpoint(models, mesh, initial, models[0].module.hf_config)
    ref_loss, ref_norm, _ = hf_bradley_terry(initial, pairs)

    mine = pairs.share(mesh)
    options = {"num_pairs": len(pairs), "pad_token_id": PAD, "micro_batch_size": 2}
    if mesh.pp == 1:
        options["max_tokens"] = 30  # token budget: pairs regrouped by length
    train = partial(train_step, models, mesh, optimizer, scheduler)
    steps = [bradley_terry_step(train, mesh, mine, **options)]
    for _ in range(3):
        steps.append(bradley_terry_step(train, mesh, mine, **options))
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
    score = partial(score_sequences, models, mesh, micro_batch_size=4)
    accuracy = pairwise_accuracy(score, mesh, pairs, pad_token_id=PAD)
    _, _, hf_accuracy = hf_bradley_terry(exported, pairs)
    assert accuracy["accuracy"] == hf_accuracy and accuracy["pairs"] == len(pairs), accuracy
    numbers["trained_accuracy"] = accuracy["accuracy"]
    return numbers


def policy_samples(tokenizer) -> list:
    """Seven samples of the quickstart's task (DP2 splits them 4 + 3), the last two unfinished."""
    from rlcli.data.dataset import PromptItem
    from rlcli.rollout.batch import Sample

    samples = []
    for i in range(7):
        question = f"Question: {i} + {2 * i} = ? Answer:"
        prompt_ids = tokenizer(question)["input_ids"]
        response_ids = tokenizer(f" #### {3 * i + i % 2}", add_special_tokens=False)["input_ids"]
        finished = i < 5
        if finished:
            response_ids.append(tokenizer.eos_token_id)
        item = PromptItem(
            index=i,
            prompt_token_ids=prompt_ids,
            data_source="arith",
            ground_truth=str(3 * i),
            prompt_messages=[{"role": "user", "content": question}],
        )
        samples.append(
            Sample(
                group=i // 2,
                prompt_ids=prompt_ids,
                response_ids=response_ids,
                engine_log_probs=[0.0] * len(response_ids),
                finish_reason="stop" if finished else "length",
                item=item,
            )
        )
    return samples


def check_step_scores(mesh: Mesh, rm_dir: str, policy_tokenizer, shares_tokenizer: bool) -> float:
    from transformers import AutoTokenizer

    from parallel.model_shapes import ModelShape, stage_params
    from rlcli.model.heads import ScoreHead
    from rlcli.model.trained_model import MicroBatching, TrainedModel
    from rlcli.reward_models.reward_model import RewardModelInputs, reward_model_scores

    pack = not shares_tokenizer  # the Qwen2 RM scores packed rows (reward.model.pack_sequences)
    budget = MicroBatching(2, pack=pack) if mesh.pp > 1 else MicroBatching(1, 0, 40, pack)
    model = TrainedModel(mesh, rm_dir, micro_batching=budget, head=ScoreHead())
    shape = ModelShape.from_hf_config(model.hf_config.to_dict())
    held = sum(p.numel() for chunk in model.models for p in chunk.parameters())
    planned = stage_params(
        shape, tp=mesh.tp, pp=mesh.pp, pp_rank=mesh.pp_rank, critic=True, head_bias=False
    )
    assert held == planned, (held, planned)
    inputs = RewardModelInputs(policy_tokenizer, AutoTokenizer.from_pretrained(rm_dir))
    assert inputs.shares_tokenizer == shares_tokenizer
    samples = policy_samples(policy_tokenizer)
    scores = reward_model_scores(model, inputs, samples)
    ids = [
        inputs(s.prompt_ids, s.response_ids, s.item.prompt_messages, s.finish_reason == "stop")
        for s in samples
    ]
    if not shares_tokenizer:
        assert ids[0] != samples[0].prompt_ids + samples[0].response_ids  # rendered anew
    reference = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    input_ids, attention_mask = pad_sequences(ids, reference.config.pad_token_id)
    with torch.no_grad():
        expected = hf_scores(reference, input_ids, attention_mask)
    diff = (scores - expected).abs().max().item()
    assert diff < TOLERANCE, (rm_dir, diff, scores, expected)
    return diff


def main() -> None:
    qwen2_rm, llama_rm, qwen2_lm, out_dir = sys.argv[1:5]
    from transformers import AutoConfig, AutoTokenizer

    policy_tokenizer = AutoTokenizer.from_pretrained(llama_rm)

    vocab = AutoConfig.from_pretrained(qwen2_rm).vocab_size
    input_ids, attention_mask = score_rows(vocab)
    pairs = preference_pairs(vocab)
    for tp, pp in LAYOUTS:
        mesh = init_parallel(tp=tp, pp=pp, seed=5)
        numbers = {
            "qwen2_score_diff": check_scores(mesh, qwen2_rm, input_ids, attention_mask),
            "llama_score_diff": check_scores(mesh, llama_rm, input_ids, attention_mask),
            **check_training(mesh, qwen2_lm, Path(out_dir), pairs),
            "step_own_template_diff": check_step_scores(mesh, qwen2_rm, policy_tokenizer, False),
            "step_policy_tokens_diff": check_step_scores(mesh, llama_rm, policy_tokenizer, True),
        }
        if dist.get_rank() == 0:
            print(f"REWARD_MODEL tp={tp} pp={pp} dp={mesh.dp}: {numbers}", flush=True)
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        print("REWARD_MODEL_WORKER_OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
