"""The ``shardcheck`` command line: a click group; exit codes are decided here only.

0: success; 1: findings or differences; 2: the input could not be used. Every error is one
line on stderr, ``shardcheck: error: ...``; ``--debug`` shows the traceback as well.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import importlib
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

import click

from shardcheck.cli.arguments import expand_list_options
from shardcheck.cli.exit_codes import exit_codes_epilog
from shardcheck.cli.json_output import echo_error_json, errors_as_json, wants_json
from shardcheck.cli.stops import Stopped, clean_up_on_signals, stopped_by
from shardcheck.errors import ShardcheckError
from shardcheck.runtime.supervised import end_process_when_overdue
from shardcheck.wording import one_line, shown

EXIT_OK = 0
EXIT_INPUT_ERROR = 2  # findings and differences are 1: the commands return it


# Write errors of a stream that has no name: standard output, the only one a command writes.
_STDOUT_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def error_line(message: str) -> None:
    text = one_line(" ".join(str(message).split()))
    with contextlib.suppress(OSError):  # a closed stderr: the exit code still says it
        click.echo(f"shardcheck: error: {text}", err=True)
    with contextlib.suppress(OSError):  # a closed stdout: the exit code still says it
        echo_error_json(text)  # under --format json, stdout gets it as JSON too


def warning_line(message: str) -> None:
    click.echo(f"shardcheck: warning: {one_line(' '.join(str(message).split()))}", err=True)


# Each command's module is imported when the command runs (or --help lists it): ``gen`` need
# not import onnxruntime or deepdiff, and a CI job pays the startup of its own command only.
COMMANDS = {
    "check": "shardcheck.cli.check:check",
    "diff": "shardcheck.cli.diff:diff",
    "explain": "shardcheck.cli.explain:explain",
    "fmt": "shardcheck.cli.fmt:fmt",
    "gen": "shardcheck.cli.gen:gen",
    "shard": "shardcheck.cli.shard:shard",
    "simulate": "shardcheck.cli.simulate:simulate_command",
    "verify": "shardcheck.cli.verify:verify_command",
}


class ShardcheckGroup(click.Group):
    """Runs a command and maps every outcome to one exit code and at most one error line."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS and cmd_name not in self.commands:
            module, attribute = COMMANDS[cmd_name].split(":")
            # Importing makes long-lived objects only: the cyclic collector would walk them
            # again and again for nothing.
            enabled = gc.isenabled()
            gc.disable()
            try:
                command = getattr(importlib.import_module(module), attribute)
            finally:
                if enabled:
                    gc.enable()
            command.epilog = command.epilog or exit_codes_epilog(cmd_name)
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context) -> Any:
        """The command; an interrupt, a signal or a closed stdout leaves as Stopped, past
        click's own handling of them."""
        try:
            result = super().invoke(ctx)
            sys.stdout.flush()  # a full disk or a closed pipe is the command's failure
            return result
        except (KeyboardInterrupt, BrokenPipeError) as exc:
            stop = stopped_by(exc)
            if stop is None:
                raise
            raise stop from None

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args and not ctx.resilient_parsing:
            # A bare ``shardcheck``: its help as click lays it out, not as one error line.
            click.echo(ctx.get_help(), err=True)
            raise click.exceptions.Exit(EXIT_INPUT_ERROR)
        return super().parse_args(ctx, args)

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        debug = "--debug" in argv or bool(os.environ.get("SHARDCHECK_DEBUG"))
        errors_as_json(wants_json(argv))
        if not debug:
            # A library's warning (onnx: "the onnxtxt format is experimental") would add lines
            # to the one-line answer; it says nothing about the input. --debug shows them.
            warnings.simplefilter("ignore")
        code = EXIT_INPUT_ERROR
        try:
            result = super().main(
                args=expand_list_options(argv),
                prog_name=prog_name or "shardcheck",
                complete_var=complete_var,
                standalone_mode=False,
                **extra,
            )
            code = result if isinstance(result, int) else EXIT_OK
        except click.exceptions.Exit as exc:
            code = exc.exit_code
        except click.exceptions.Abort:
            error_line("aborted")
            code = 130
        except Stopped as exc:
            if exc.message is not None:
                error_line(exc.message)
            code = exc.exit_code
        except click.ClickException as exc:
            where = exc.ctx.command_path + ": " if getattr(exc, "ctx", None) else ""
            hint = f" (see '{exc.ctx.command_path} --help')" if getattr(exc, "ctx", None) else ""
            error_line(f"{where}{exc.format_message()}{hint}")
            code = EXIT_INPUT_ERROR
        except ShardcheckError as exc:
            if debug:
                traceback.print_exc()
            error_line(exc.message)
            code = exc.exit_code
        except KeyboardInterrupt:
            error_line("interrupted")
            code = 130
        except OSError as exc:
            if debug:
                traceback.print_exc()
            error_line(_os_error_message(exc))
            code = EXIT_INPUT_ERROR
        except Exception as exc:
            if debug:
                traceback.print_exc()
            error_line(
                f"internal error: {type(exc).__name__}: {exc} "
                "(this is a bug in shardcheck; rerun with --debug for the traceback)"
            )
            code = EXIT_INPUT_ERROR
        if standalone_mode:
            sys.exit(code)
        return code


def _os_error_message(exc: OSError) -> str:
    """A system error no reader caught, as "FILE: what is wrong" when it names its file."""
    why = exc.strerror or str(exc)
    if exc.filename is not None:
        return f"{shown(os.fsdecode(exc.filename))}: {why}"
    if exc.errno in _STDOUT_ERRORS:
        return f"-: cannot write to standard output: {why}"
    return (
        f"internal error: {type(exc).__name__}: {exc} "
        "(this is a bug in shardcheck; rerun with --debug for the traceback)"
    )


@click.group(cls=ShardcheckGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show Python tracebacks on errors.")
@click.version_option(package_name="shardcheck")
def cli(debug: bool) -> None:
    """Generate, verify and gate context-parallel shard hints for ONNX models."""


def _end_overdue(message: str) -> None:
    """A run past --timeout (a timer's thread): its error line, then the process ends, which
    frees the run's memory; no file is being written while onnxruntime runs."""
    error_line(message)
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(EXIT_INPUT_ERROR)


def main() -> None:
    """The console command. It leaves without the interpreter's teardown: onnxruntime may
    still be making a session in a background thread (verify's, or a simulation's that will
    not run), and tearing the runtime down under it crashes the process (a segfault or
    "terminate called without an active exception"), whose exit code would replace the
    verdict's. Everything it writes is flushed or closed first.

    The cyclic collector is off for the process: nothing the commands make forms a cycle, and
    its collections would only walk, again and again, what lives until the command ends."""
    gc.disable()
    clean_up_on_signals()
    end_process_when_overdue(_end_overdue)
    code = cli.main(standalone_mode=False)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe (| head) says no more
            stream.flush()
    os._exit(code)
