"""Run under torchrun (1 or 2 CPU processes: TP1 or TP2). Used by test_vision_language.py.

    vision_language_worker.py HF_DIR TP

A tiny Qwen2.5-VL through the training step's own path: two right-padded rows of different
lengths, one image each (4 x 4 and 4 x 6 patches), as a MicroBatch (patches padded per row,
multimodal positions [b, S, 3]) cut into micro-batches of 1 and of 2 rows and run through
parallel.schedule.forward_backward. Checks, against transformers on the same rows and images:
the per-token log-probs of every real token, also of a response that holds the image token (read
as text, as the engines read a sampled one); then one backward pass: gradients reach the
language model, none the frozen vision tower; a trained tower's gradients equal transformers'. Prints "OK ..." on rank 0.
"""

from __future__ import annotations

import sys

import torch

from parallel.hf_model import load_hf_model
from parallel.mesh import init_parallel
from parallel.micro_batches import micro_batches
from parallel.schedule import forward_backward
from parallel.step_types import LossReport, MicroBatch
from parallel.vision_language import mrope_position_ids
from rlcli.process_lifetime import exit_skipping_teardown

IMAGE, START, END = 250, 248, 249
PATCH = 3 * 2 * 14 * 14  # channels x temporal patch x patch x patch


def rows() -> tuple[MicroBatch, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    text = lambda n: torch.randint(1, 240, (n,), generator=generator).tolist()  # noqa: E731
    row0 = [*text(2), START, *[IMAGE] * 4, END, *text(6)]  # 4 x 4 patches -> 4 placeholders
    row1 = [*text(1), START, *[IMAGE] * 6, END, *text(10)]  # 4 x 6 -> 6
    length = max(len(row0), len(row1))
    ids = torch.zeros(2, length, dtype=torch.long)
    mask = torch.zeros(2, length, dtype=torch.long)
    for r, row in enumerate((row0, row1)):
        ids[r, : len(row)], mask[r, : len(row)] = torch.tensor(row), 1
    grids = torch.tensor([[1, 4, 4], [1, 4, 6]])
    pixels = torch.randn(16 + 24, PATCH, generator=generator)
    per_row = torch.zeros(2, 24, PATCH)
    per_row[0, :16], per_row[1] = pixels[:16], pixels[16:]
    positions = mrope_position_ids(ids, grids, IMAGE, 2, mask)  # [3, b, S]
    batch = MicroBatch(
        input_ids=ids, attention_mask=mask, position_ids=positions.permute(1, 2, 0),
        row_index=torch.arange(2), pixel_values=per_row, image_grid_thw=grids[:, None, :],
    )  # fmt: skip
    hf = {
        "input_ids": ids, "attention_mask": mask, "pixel_values": pixels,
        "image_grid_thw": grids, "mm_token_type_ids": (ids == IMAGE).int(),
    }  # fmt: skip
    return batch, hf


def sampled_image_token(models, mesh, hf_model) -> float:
    """A response the policy sampled may hold the image token; the engines read it as text (its
    embedding, positions counting on from the prompt's). transformers as generate runs it: the
    prompt with its image, then the response on the cache. Returns the largest difference."""
    generator = torch.Generator().manual_seed(5)
    prompt = [7, START, *[IMAGE] * 4, END, 9]
    response = [11, IMAGE, 12, IMAGE, 13]
    grid = torch.tensor([[1, 4, 4]])
    pixels = torch.randn(16, PATCH, generator=generator)
    prompt_ids = torch.tensor([prompt])
    with torch.no_grad():
        first = hf_model(
            input_ids=prompt_ids, pixel_values=pixels, image_grid_thw=grid,
            mm_token_type_ids=(prompt_ids == IMAGE).int(), use_cache=True,
        )  # fmt: skip
        rest = hf_model(input_ids=torch.tensor([response]), past_key_values=first.past_key_values)
    logits = torch.cat([first.logits[0, -1:], rest.logits[0, :-1]])
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]

    ids = torch.tensor([prompt + response])
    positions = mrope_position_ids(torch.tensor([prompt]), grid, IMAGE, 2)[:, 0].T
    after = (torch.arange(len(response))[:, None] + positions.max() + 1).expand(-1, 3)
    batch = MicroBatch(
        input_ids=ids, attention_mask=torch.ones_like(ids),
        position_ids=torch.cat([positions, after])[None], row_index=torch.arange(1),
        pixel_values=pixels[None], image_grid_thw=grid[None],
    )  # fmt: skip
    [result] = forward_backward(models, mesh, [batch], None, forward_only=True)
    got = result.outputs.log_probs.cpu()[0, len(prompt) - 1 :]
    worst = (got - want).abs().max().item()
    assert worst < 1e-5, worst
    return worst


def trained_tower_gradients(hf_dir, mesh, batch, hf_model, hf_inputs, loss) -> float:
    """model.freeze_vision_tower=false: the tower's gradients of the summed log-probs, in
    micro-batches of one row, equal transformers' of the same sum on every TP rank. Returns the
    largest difference relative to the largest gradient."""
    from parallel.model_options import ModelBuildOptions

    models = load_hf_model(hf_dir, mesh, options=ModelBuildOptions(train_vision_tower=True))
    forward_backward(models, mesh, micro_batches(batch, 1), loss, forward_only=False)
    hf_model.zero_grad()
    logits = hf_model(**hf_inputs).logits
    log_probs = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])
    (-(log_probs[..., 0] * batch.attention_mask[:, 1:]).sum()).backward()
    want = dict(hf_model.model.visual.named_parameters())
    worst, scale = 0.0, max(p.grad.abs().max().item() for p in want.values())
    for name, param in models[0].visual.named_parameters():
        assert param.grad is not None, f"no gradient on the trained tower's {name}"
        worst = max(worst, (param.grad - want[name].grad).abs().max().item() / scale)
    assert worst < 1e-4, worst
    return worst


def main(hf_dir: str) -> None:
    from transformers import AutoModelForImageTextToText

    mesh = init_parallel(tp=int(sys.argv[2]))
    models = load_hf_model(hf_dir, mesh)
    batch, hf_inputs = rows()
    hf_model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf_model(**hf_inputs).logits
    want = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    real = batch.attention_mask[:, 1:].bool()

    worst = 0.0
    for size in (1, 2):
        got = torch.zeros_like(want)
        chunks = micro_batches(batch, size)
        results = forward_backward(models, mesh, chunks, None, forward_only=True)
        for chunk, result in zip(chunks, results, strict=True):
            log_probs = result.outputs.log_probs.cpu()
            got[chunk.row_index, : log_probs.shape[1]] = log_probs
        worst = max(worst, (got - want)[real].abs().max().item())
    assert worst < 1e-5, worst

    def loss(outputs, mb):
        return -(outputs.log_probs * mb.attention_mask[:, 1:].to(outputs.log_probs)).sum(), (
            LossReport()
        )

    stray = sampled_image_token(models, mesh, hf_model)

    forward_backward(models, mesh, micro_batches(batch, 1), loss, forward_only=False)
    chunk = models[0]
    language = [p for n, p in chunk.named_parameters() if not n.startswith("visual.")]
    tower = list(chunk.visual.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in language), "no LM gradient"
    assert all(not p.requires_grad and p.grad is None for p in tower), "the frozen tower moved"
    trained = trained_tower_gradients(hf_dir, mesh, batch, hf_model, hf_inputs, loss)
    if mesh.rank == 0:
        print(
            f"OK tp={mesh.tp} max |log-prob diff| {worst:.2e} ({stray:.2e} with a sampled image "
            f"token); gradients on "
            f"{len(language)} language-model tensors, none on {len(tower)} tower tensors; a "
            f"trained tower's gradients within {trained:.2e} of transformers'"
        )


if __name__ == "__main__":
    main(sys.argv[1])
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
