"""The simplest GRPO loop a user could write without a framework, for the benchmark's comparison
with rlcli's trainer on the same model, batch and task:

    plain_grpo_step_seconds(model_dir, prompts=8, n=8, max_tokens=12, lr=..., steps=4) -> list

One process, one HF model: ``generate`` samples ``n`` responses per prompt (temperature 1), the
arith reward scores them, GRPO advantages are the group-normalised scores, then ONE forward with
gradients gives the sampled tokens' log-probs; the loss is the on-policy clipped surrogate (its
ratio is exactly 1, so it is ``-A * logp`` in value and gradient, token-mean), and torch AdamW
steps. The weights the next ``generate`` uses are the updated ones (no sync needed).
"""

from __future__ import annotations

import time

import torch


def plain_grpo_step_seconds(
    model_dir: str,
    *,
    prompts: int = 8,
    n: int = 8,
    max_tokens: int = 12,
    lr: float = 3e-5,
    steps: int = 4,
    seed: int = 0,
) -> list[float]:
    """Seconds of each of ``steps`` timed GRPO steps (after one untimed warm-up step)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcli.data.synthetic import arith_split
    from rlcli.rewards.arith import compute_score

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    examples, _ = arith_split()
    seconds: list[float] = []
    for step in range(steps + 1):
        start = time.perf_counter()
        chosen = examples[step * prompts : (step + 1) * prompts]
        tokenizer.padding_side = "left"  # generate continues every row from its last token
        enc = tokenizer([e.prompt_text for e in chosen], return_tensors="pt", padding=True)
        model.eval()
        with torch.no_grad():
            out = model.generate(
                **enc, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=max_tokens,
                num_return_sequences=n, pad_token_id=pad,
            )  # fmt: skip
        prompt_len = enc["input_ids"].shape[1]
        responses = out[:, prompt_len:]
        # Tokens after the first EOS are padding; the EOS itself is scored.
        ended = (responses == tokenizer.eos_token_id).int().cumsum(dim=1)
        response_mask = (ended == 0) | ((ended == 1) & (responses == tokenizer.eos_token_id))
        texts = tokenizer.batch_decode(responses * response_mask, skip_special_tokens=True)
        scores = torch.tensor(
            [compute_score("arith", t, str(chosen[i // n].answer))["score"]
             for i, t in enumerate(texts)]
        )  # fmt: skip
        grouped = scores.view(prompts, n)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True)
                      + 1e-6)).view(-1, 1)  # fmt: skip
        model.train()
        attention = torch.cat([enc["attention_mask"].repeat_interleave(n, 0), response_mask], 1)
        logits = model(input_ids=out, attention_mask=attention.long()).logits[
            :, prompt_len - 1 : -1
        ]
        log_probs = torch.log_softmax(logits.float(), -1).gather(-1, responses[..., None])[..., 0]
        mask = response_mask.float()
        loss = -(advantages * log_probs * mask).sum() / mask.sum().clamp(min=1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step > 0:
            seconds.append(time.perf_counter() - start)
    return seconds
