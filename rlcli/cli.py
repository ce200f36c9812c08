"""The ``rlcli`` command line: this module assembles the typer app from ``rlcli.commands`` and
runs it (``main``); every command lives in ``rlcli/commands/``.

Heavy imports (torch, megatron-core, vLLM) happen inside the commands, so ``rlcli --help`` and
``rlcli config show`` answer in a fraction of a second.
"""

from __future__ import annotations

import sys
import traceback

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
from rlcli.console import quiet_third_party_noise
from rlcli.errors import USER_ERROR_EXIT_CODE, UserError
from rlcli.process_lifetime import (
    exit_skipping_teardown,
    forked_by_torchrun,
    run_exit_hooks,
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


def main(argv: list[str] | None = None) -> None:
    """Console entry point. Usage mistakes (unknown command or option, missing argument) print
    typer's short usage message and exit 2; a :class:`UserError` prints one line and exits 2
    (under ``--nproc`` the parent prints it: ``rlcli.commands.relaunch``); never a traceback."""
    quiet_third_party_noise()
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


def run() -> None:
    """The ``rlcli`` program (its console script and ``python -m rlcli.cli``): :func:`main`, then
    an exit without the interpreter's teardown (``exit_skipping_teardown``: 2 s a process). An
    unexpected exception still ends the usual way, with its traceback. A rank that torchrun
    forked (``rlcli.commands.relaunch``) returns when it succeeds: torchrun's wrapper collects
    its result. (Tests call :func:`main` in their own process, which must end as pytest
    decides.)"""
    forked = forked_by_torchrun()
    try:
        main()
    except SystemExit as stop:
        if stop.code not in (None, 0) or not forked:
            exit_skipping_teardown(stop.code)
    except BaseException:  # a rank torchrun forked: its traceback, as a process would print it
        if not forked:
            raise
        traceback.print_exc()
        exit_skipping_teardown(1)
    if not forked:
        exit_skipping_teardown(0)
    run_exit_hooks()  # torchrun's wrapper hands the agent the rank's result, then exits


if __name__ == "__main__":
    run()
