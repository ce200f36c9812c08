"""Check 11 of the GPU check: a vision-language model (Qwen2.5-VL) on the GPU.

A random Qwen2.5-VL (transformers' own vision tower in front of megatron's GPT model with
multimodal RoPE): Megatron's logits against transformers' on a batch with one image a row, in
fp32 and in bf16 (judged by HF's own bf16 error); one bf16 backward whose gradients reach the
language model and never the frozen tower; and the HF rollout engine generating from the same
image (its first greedy token equal to the argmax of transformers' logits). No processor or
torchvision is needed: the batch's pixels are random patches (``parallel.vision_language``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlcli.model.vision_builder import mrope_section
from tests.gpu.common import BF16, Context

TEXT_GPU = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=2, intermediate_size=1024, vocab_size=4099)  # fmt: skip
TEXT_CPU = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, intermediate_size=96, vocab_size=251)  # fmt: skip


def make_vision_language_model(out_dir: Path, text: dict, seed: int) -> Path:
    """A random fp32 Qwen2.5-VL; its special tokens at the top of the vocabulary."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if (out_dir / "config.json").exists():
        return out_dir
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope_section(head_dim)}
    vocab = text["vocab_size"]
    config = Qwen2_5_VLConfig(
        text_config={**text, "max_position_embeddings": 1024, "rope_parameters": rope},
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                           out_hidden_size=text["hidden_size"], fullatt_block_indexes=[1]),
        image_token_id=vocab - 1, video_token_id=vocab - 4, vision_start_token_id=vocab - 3,
        vision_end_token_id=vocab - 2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(config).float().save_pretrained(out_dir)
    return out_dir


def check_vision_language(ctx: Context) -> tuple[bool, str]:
    from transformers import AutoModelForImageTextToText

    from parallel.hf_model import load_hf_model
    from parallel.vision_language import verify_batch
    from rlcli.data.images import ProcessedPrompt
    from rlcli.rollout.base import GenerationRequest, SamplingConfig
    from rlcli.rollout.hf_engine import HFEngine

    model_dir = make_vision_language_model(
        ctx.work / "vision_language", TEXT_CPU if ctx.cpu else TEXT_GPU, 0
    )
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    hf = hf.to(ctx.device).eval()
    vocab = hf.config.text_config.vocab_size
    batch = verify_batch(hf.config, vocab, batch=2, length=24 if ctx.cpu else 256)
    inputs = {k: v.to(ctx.device) for k, v in batch.hf_inputs(hf.config.image_token_id).items()}
    with torch.no_grad():
        reference = hf(**inputs).logits.float()
        hf_err = float((hf.to(BF16)(**inputs).logits.float() - reference).abs().mean())
    del hf
    images = batch.images.to(ctx.device)
    tokens, positions = batch.tokens.to(ctx.device), batch.positions.to(ctx.device)
    parts, ok = [], True
    for dtype in (torch.float32, BF16):
        models = load_hf_model(model_dir, ctx.mesh, dtype=dtype)
        logits = models[0](tokens, positions, attention_mask=None, images=images)
        diff = (logits[..., :vocab].float().detach() - reference).abs()
        if dtype == torch.float32:
            good = float(diff.max()) < 1e-3
            parts.append(f"fp32 max|dlogit| {float(diff.max()):.2e} {'ok' if good else 'TOO FAR'}")
        else:
            good = float(diff.mean()) <= 2 * hf_err + 1e-3
            logits.float().log_softmax(-1).mean().backward()
            chunk = models[0]
            language = [p for n, p in chunk.named_parameters() if not n.startswith("visual.")]
            tower = list(chunk.visual.parameters())
            reached = all(p.grad is not None and bool(p.grad.isfinite().all()) for p in language)
            frozen = all(p.grad is None for p in tower)
            good = good and reached and frozen
            parts.append(
                f"bf16 mean|dlogit| {float(diff.mean()):.2e} (HF bf16 {hf_err:.2e}); grads on "
                f"{len(language)} LM tensors {'finite' if reached else 'MISSING'}, tower "
                f"{'frozen' if frozen else 'MOVED'}"
            )
        ok = ok and good
        del models

    # The HF engine from the same image: its first greedy token is transformers' argmax.
    engine = HFEngine(str(model_dir), dtype="float32")
    patches = int(batch.images.grid_thw[0].prod())
    prompt = ProcessedPrompt(
        text="", token_ids=batch.tokens[0].tolist(),
        pixel_values=batch.images.pixel_values[:patches], image_grid_thw=batch.images.grid_thw[:1],
        positions=batch.positions[:, 0].T, images=[],
    )  # fmt: skip
    request = GenerationRequest(
        prompt.token_ids, SamplingConfig(temperature=0, max_tokens=2), 1, 0, prompt
    )
    [[completion]] = engine.generate_requests([request])
    same = completion.token_ids[0] == int(reference[0, -1].argmax())
    parts.append(f"HF engine with the image: first greedy token {'= HF' if same else '!= HF'}")
    engine.close()
    return ok and same, "; ".join(parts)
