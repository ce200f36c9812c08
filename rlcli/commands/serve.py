"""``rlcli serve MODEL``: a model folder (or a training checkpoint) behind the same
OpenAI-compatible endpoint agents call while they train (``rlcli.rollout.agents``), so an agent
can be tried or evaluated with any OpenAI client before and after training.

Calls here honour the request's own ``temperature`` / ``top_p`` (training uses the run's); every
call is answered on ``/v1/...`` with the API key printed at start (or ``--api-key``).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Optional

import typer

from rlcli.errors import UserError


def serve_command(
    model: Path = typer.Argument(
        ..., help="An HF model folder, or a training checkpoint (exported to a temporary folder)."
    ),
    engine: str = typer.Option("vllm", "--engine", help="vllm | hf"),
    host: str = typer.Option("127.0.0.1", "--host", help="Where to listen (loopback by default)."),
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free one)."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", help="The key clients must send (default: a new one, printed)."
    ),
    model_name: str = typer.Option("policy", "--model-name", help="The model name clients pass."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Largest completion per call."),
    max_model_len: int = typer.Option(2048, "--max-model-len", help="Prompt + completion."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
) -> None:
    """Serve a model folder or checkpoint through the OpenAI-compatible agent endpoint."""
    from transformers import AutoTokenizer

    from rlcli.config.schema import RolloutConfig
    from rlcli.rollout.agents.routes import start_endpoint
    from rlcli.rollout.agents.server import AgentServer
    from rlcli.rollout.base import SamplingConfig
    from rlcli.rollout.factory import make_engine

    if engine not in ("vllm", "hf"):
        raise UserError(f"--engine {engine!r}: choose vllm or hf")
    # Ctrl-C / `kill -INT` and `kill` (SIGTERM) stop the server in order, also when it was
    # started with SIGINT ignored (a background job, or a parent that ignores it): Python then
    # keeps the inherited SIG_IGN and no KeyboardInterrupt would ever come.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with tempfile.TemporaryDirectory(prefix="rlcli-serve-") as scratch:
        folder = _model_folder(model, Path(scratch))
        tokenizer = AutoTokenizer.from_pretrained(folder)
        section = RolloutConfig(engine=engine, load_format="auto")
        rollout_engine = make_engine(section, str(folder), dtype=dtype, max_model_len=max_model_len)
        server = AgentServer(
            tokenizer,
            "MODEL",
            model_name,
            host=host,
            port=port,
            api_key=api_key,
            open_routes=True,
            max_model_len=max_model_len,
        )
        server.configure(SamplingConfig(max_tokens=max_tokens), replica_index=0)
        start_endpoint(server)
        typer.echo(f"[rlcli] serving {folder} as {model_name!r} at {server.base_url()}")
        typer.echo(f"[rlcli] api key: {server.api_key}")
        stopped = False
        try:
            rollout_engine.wake_up()
            while True:
                batch = server.next_batch(running=1, poll_s=0.5)
                if batch:
                    try:
                        results = rollout_engine.generate_requests([p.request for p in batch])
                    except Exception as error:
                        for pending in batch:
                            pending.future.set_exception(error)
                        raise
                    for pending, completions in zip(batch, results, strict=True):
                        pending.future.set_result(completions)
        except KeyboardInterrupt:
            typer.echo("[rlcli] stopping")
            stopped = True
        finally:
            server.stop()
            rollout_engine.close()
    if stopped:
        # Ctrl-C: the endpoint and the engine are closed and the scratch folder removed; leave
        # now rather than wait on whatever a library left running at interpreter exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _model_folder(path: Path, scratch: Path) -> Path:
    """``path`` when it is an HF model folder; a checkpoint's policy exported into ``scratch``."""
    if (path / "config.json").is_file():
        return path
    from rlcli.commands.export import export

    if not path.exists():
        raise UserError(f"{path} does not exist: give an HF model folder or a training checkpoint")
    out = scratch / "model"
    export(path, out=out, overwrite=False, critic=False, lora=False, merge=False, base_model=None)
    return out
