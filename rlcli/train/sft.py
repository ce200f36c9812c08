"""Supervised warm start on Megatron: cross-entropy on the response tokens of prompt/response pairs,
and on the assistant turns of conversations (``rlcli.data.sft_rows``).

Uses the same model, batch layout and forward/backward schedule as RL; the result is written as
an ordinary HF model directory, which RL (and the rollout engine) then start from. A conversation
is tokenized the way a multi-turn rollout builds a trajectory (``rlcli.tools.rendering``): its
prompt rendered with the run's tools, each assistant turn as the engine would generate it (loss
mask 1), each tool / user message rendered alone and appended (loss mask 0).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch.distributed as dist

from parallel.step_types import LossReport, ModelOutputs
from rlcli.data.sft_rows import SFTConversation, SFTImagePrompt, SFTRow, read_sft_rows
from rlcli.errors import UserError
from rlcli.model.trained_model import TrainedModel
from rlcli.rollout.batch import RolloutBatch, Sample, collate, response_values, split_evenly
from rlcli.run.checkpoints import CheckpointManager
from rlcli.run.state import RunState
from rlcli.tools.rendering import MessageRenderer
from rlcli.train.inputs import RunInputs, tokenizer_setting
from rlcli.train.save_resume import CheckpointedModel, RunCheckpoints


def tokenize_pairs(pairs: list[tuple[str, str]], tokenizer) -> list[Sample]:
    eos = tokenizer.eos_token_id
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    responses = tokenizer([r for _, r in pairs], add_special_tokens=False)["input_ids"]
    return [
        Sample(
            group=i,
            prompt_ids=p,
            response_ids=r + [eos],
            engine_log_probs=[0.0] * (len(r) + 1),
            finish_reason="stop",
            item=None,
        )
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True))
    ]


def tokenize_conversations(
    conversations: list[SFTConversation], renderer: MessageRenderer, first_group: int = 0
) -> list[Sample]:
    """Conversations as samples whose ``loss_mask`` is 1 exactly on the assistant turns."""
    samples = []
    for number, conversation in enumerate(conversations):
        response: list[int] = []
        mask: list[int] = []
        turns = conversation.messages[conversation.first_assistant :]
        position = 0
        while position < len(turns):
            generated = renderer.assistant_ids(turns[position]["content"])
            response += generated
            mask += [1] * len(generated)
            position += 1
            following = []
            while position < len(turns) and turns[position]["role"] != "assistant":
                following.append(turns[position])
                position += 1
            if following:
                appended = renderer.append_ids(generated, following)
                response += appended
                mask += [0] * len(appended)
        samples.append(
            Sample(
                group=first_group + number,
                prompt_ids=renderer.prompt_ids(conversation.prompt),
                response_ids=response,
                engine_log_probs=[0.0] * len(response),
                finish_reason="stop",
                item=None,
                loss_mask=mask,
            )
        )
    return samples


def tokenize_image_prompts(rows: list[SFTImagePrompt], c: RunInputs) -> list[Sample]:
    """Prompts with images, rendered and processed by the model's processor; the response
    tokenized as a pair's is (EOS appended)."""
    from rlcli.data import PromptItem
    from rlcli.data.images import prompt_with_images

    if c.processor is None:
        raise UserError(
            f"{rows[0].location}: an SFT row with images needs a vision-language model "
            "(model.path) with its image processor"
        )
    eos = c.tokenizer.eos_token_id
    samples = []
    for number, row in enumerate(rows):
        prompt = prompt_with_images(c.processor, row.messages, row.images, row.location, "prompt")
        response = c.tokenizer(row.response, add_special_tokens=False)["input_ids"] + [eos]
        item = PromptItem(number, prompt.token_ids, "sft", None, image_inputs=prompt)
        samples.append(
            Sample(number, prompt.token_ids, response, [0.0] * len(response), "stop", item)
        )
    return samples


def tokenize_rows(rows: list[SFTRow], c: RunInputs) -> list[Sample]:
    """Pairs first, then prompts with images, then conversations (rendered with their own
    tools, else the run's)."""
    pairs = [row for row in rows if isinstance(row, tuple)]
    with_images = [row for row in rows if isinstance(row, SFTImagePrompt)]
    conversations = [row for row in rows if isinstance(row, SFTConversation)]
    samples = tokenize_pairs(pairs, c.tokenizer) if pairs else []
    if with_images:
        numbered = tokenize_image_prompts(with_images, c)
        for sample in numbered:
            sample.group += len(samples)
        samples += numbered
    if conversations:
        from rlcli.tools.multi_turn import prompt_tools

        run_tools = prompt_tools(c.cfg.rollout.multi_turn)
        by_tools: dict[str, list[SFTConversation]] = {}
        for conversation in conversations:
            tools = conversation.tools if conversation.tools is not None else run_tools
            by_tools.setdefault(json.dumps(tools, sort_keys=True), []).append(conversation)
        for key, group in by_tools.items():
            renderer = MessageRenderer(c.tokenizer, json.loads(key), tokenizer_setting(c.cfg))
            samples += tokenize_conversations(group, renderer, len(samples))
    return samples


def generated_tokens(sample: Sample) -> int:
    return len(sample.response_ids) if sample.loss_mask is None else sum(sample.loss_mask)


def make_sft_loss(denominator: float):
    def loss_fn(outputs: ModelOutputs, mb: RolloutBatch):
        mask = mb.loss_mask.to(outputs.log_probs.device)
        log_prob = response_values(outputs.log_probs, mb.response_index)
        nll = -(log_prob * mask).sum() / denominator
        return nll, LossReport({"sft/loss": nll.item()})

    return loss_fn


def sft_checkpoints(c: RunInputs, actor: TrainedModel) -> RunCheckpoints:
    """The warm start's checkpoints (``sft.save_freq``): ``<output_dir>/sft_checkpoints``, saved
    and resumed as an RL run's are; an interrupted warm start continues from the newest intact
    one unless ``trainer.resume=none``."""
    return RunCheckpoints(
        CheckpointManager(c.output_dir / "sft_checkpoints", keep_last=c.cfg.checkpoint.keep_last),
        [CheckpointedModel("model", actor, role="the SFT policy")],
        fix="Lower sft.lr, keep actor.grad_clip > 0, or use model.dtype=float32 / bfloat16 "
        "instead of float16.",
    )


def sft_warm_start(
    c: RunInputs,
    build_actor: Callable[[], TrainedModel],
    files: list[str],
    out_dir: Path,
    log: Callable[[str], None] = print,
    fresh: bool = False,
) -> Path:
    """Train ``sft.steps`` steps on ``files`` from a fresh ``build_actor()`` (built once the
    inputs are checked), or from the newest SFT checkpoint (``sft_checkpoints``) unless
    ``fresh`` (they belong to a warm start of other settings); save it as HF into ``out_dir``."""
    from parallel.convert import save_hf_checkpoint

    cfg, mesh = c.cfg, c.mesh
    if not files:
        raise UserError(
            "sft.steps > 0 needs SFT pairs: set sft.train_files (JSONL with prompt/response)"
        )
    samples = tokenize_rows([row for f in files for row in read_sft_rows(f)], c)
    if len(samples) < cfg.sft.batch_size:
        raise UserError(f"sft.batch_size={cfg.sft.batch_size} exceeds the {len(samples)} SFT pairs")
    actor = build_actor()
    rng = np.random.default_rng(cfg.trainer.seed)
    checkpoints, done = sft_checkpoints(c, actor), 0
    fresh = fresh or str(cfg.trainer.resume).lower() in ("none", "null", "")
    resumed = checkpoints.resume("none" if fresh else "auto")
    if resumed is not None:
        if resumed.state.sampler is None:
            raise UserError(f"{resumed.path} is not an SFT warm start's checkpoint (no sampler)")
        rng.bit_generator.state = resumed.state.sampler
        done = resumed.state.step
        log(f"resumed the SFT warm start from {resumed.path} (step {done})")
    start = time.perf_counter()
    for step in range(done + 1, cfg.sft.steps + 1):
        chosen = [samples[i] for i in rng.choice(len(samples), cfg.sft.batch_size, replace=False)]
        local = split_evenly(chosen, mesh.dp)[mesh.dp_rank]
        batch = collate(local, c.tokenizer.pad_token_id)
        tokens = sum(generated_tokens(s) for s in chosen)  # of the whole batch, all DP ranks
        result = actor.train_step(batch, make_sft_loss(tokens / mesh.dp))
        if step % 50 == 0 or step == cfg.sft.steps:
            loss = sum(report.metrics["sft/loss"] for report in result.reports)
            log(
                f"sft step {step}/{cfg.sft.steps}: loss {loss:.4f} "
                f"({time.perf_counter() - start:.1f} s)"
            )
        if cfg.sft.save_freq and step % cfg.sft.save_freq == 0:
            checkpoints.save(step, RunState(step=step, sampler=rng.bit_generator.state))
    save_hf_checkpoint(actor.models, mesh, str(out_dir), actor.hf_config, tokenizer_dir=c.model_dir)
    if dist.is_initialized():
        dist.barrier()
    del actor
    return out_dir
