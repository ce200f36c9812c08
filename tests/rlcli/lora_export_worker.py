"""The trained policy of a LoRA run, rebuilt the way the trainer holds it: the base from the HF
folder the run trained from, adapters added (parallel.lora.apply_lora with the checkpoint's
spec), the checkpoint's adapters loaded; its logits on the given tokens are saved for
test_lora_train.py to compare with PEFT loading the exported adapter.

    python lora_export_worker.py CHECKPOINT TOKENS.pt OUT.pt
"""

from __future__ import annotations

import sys

import torch

from rlcli.process_lifetime import exit_skipping_teardown


def main() -> None:
    checkpoint, tokens_file, out_file = sys.argv[1:]
    from parallel.checkpoint import load_checkpoint
    from parallel.hf_model import load_hf_model
    from parallel.lora import adapter_params, apply_lora
    from parallel.mesh import destroy_parallel, init_parallel
    from parallel.parity import megatron_logits
    from rlcli.model.lora import spec_of_state
    from rlcli.run.state import load_run_state

    state = load_run_state(checkpoint, rank=0, restore_rng=False)
    mesh = init_parallel(tp=1, pp=1)
    models = load_hf_model(state.model_dir, mesh)
    apply_lora(models, spec_of_state(state))
    load_checkpoint(f"{checkpoint}/model", models, mesh, adapters_only=True)
    for chunk in models:
        chunk.eval()  # the policy itself, not a dropout sample of it
    tokens = torch.load(tokens_file)
    with torch.no_grad():
        logits = megatron_logits(models, mesh, tokens)
    largest_b = max(
        entry.param.abs().max().item() for entry in adapter_params(models) if entry.matrix == "B"
    )
    torch.save({"logits": logits, "largest_b": largest_b}, out_file)
    destroy_parallel()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # (2 s of interpreter teardown a rank)
