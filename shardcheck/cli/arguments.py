"""Argument helpers shared by the commands."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import click

from shardcheck.wording import shown

F = TypeVar("F", bound=Callable[..., Any])

# Options that Polygraphy takes as space-separated integer lists (argparse nargs="*").
LIST_OPTIONS = ("--groups", "--q-shuffle", "--k-shuffle", "--v-shuffle")
_INT_LIST = re.compile(r"^\d+(,\d+)*$")
# Not a list, but meant as one ("1,2,x", "-1", "1.5"): taken as the value, so that the option
# says what is wrong with it instead of click calling it an extra argument or an option. A
# path (a / or an extension: "d,1/m.onnx", "a,b.onnx") is an argument, commas or not.
_MEANT_AS_LIST = re.compile(r"^(-\d[\w.,-]*|\d+\.\d*|\w*,[\w,-]*)$")


def expand_list_options(args: Sequence[str]) -> list[str]:
    """Rewrite ``--groups 0 1`` as ``--groups=0,1`` so click sees one value.

    ``--groups`` with no number after it means an empty list, as in Polygraphy.
    """
    result: list[str] = []
    position = 0
    while position < len(args):
        token = args[position]
        position += 1
        if token == "--":
            result.extend(args[position - 1 :])
            break
        if token not in LIST_OPTIONS:
            result.append(token)
            continue
        values: list[str] = []
        while position < len(args) and _INT_LIST.match(args[position]):
            values.append(args[position])
            position += 1
        if position < len(args) and _MEANT_AS_LIST.match(args[position]):
            values.append(args[position])
            position += 1
        result.append(f"{token}={','.join(values)}")
    return result


_ASCII_INT = re.compile(r"-?[0-9]+")


def ascii_int(text: str) -> int:
    """``text`` as an integer in ASCII digits (surrounding spaces allowed); ValueError for
    anything else. ``int`` takes other scripts' digits ("١٦" is 16) and "1_000"."""
    stripped = text.strip()
    if not _ASCII_INT.fullmatch(stripped):
        raise ValueError(text)
    return int(stripped)


class IntList(click.ParamType):
    """Comma-separated non-negative integers; the empty string is the empty list."""

    name = "INTS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        text = str(value).strip()
        if not text:
            return ()
        try:
            numbers = tuple(ascii_int(part) for part in text.split(","))
        except ValueError:
            self.fail(f"expected integers separated by spaces or commas, got {value!r}", param, ctx)
        if any(n < 0 for n in numbers):
            self.fail(f"expected non-negative integers, got {value!r}", param, ctx)
        return numbers


INT_LIST = IntList()


class DimSetting(click.ParamType):
    """``NAME=VALUE``, VALUE a positive integer (``--dim``)."""

    name = "NAME=VALUE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        name, sep, number = str(value).partition("=")
        if not sep or not name or not _ASCII_INT.fullmatch(number) or int(number) < 1:
            self.fail(
                f"expected NAME=VALUE with a positive integer, got {shown(str(value))}", param, ctx
            )
        return name, int(number)


DIM_SETTING = DimSetting()
# ``--dim NAME=VALUE`` of the commands that size a model's other dims (verify, explain).
DIM_OPTION = click.option(
    "--dim",
    "dims",
    multiple=True,
    type=DIM_SETTING,
    metavar="NAME=VALUE",
    help="Value of another symbolic dim (repeatable); batch-like dims default to 1.",
)


def dims_mapping(settings: tuple[tuple[str, int], ...]) -> dict[str, int]:
    """The ``--dim`` settings as a mapping; a dim given twice is a usage error."""
    names = [name for name, _ in settings]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise click.BadParameter(f"--dim {repeated[0]} is given more than once", param_hint="--dim")
    return dict(settings)


# ``--format``: the same choice on every command that reports.
FORMAT_OPTION = click.option(
    "--format",
    "output_format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="text for people, json for machines (the same content).",
)


# ``-q``: on every command that reports.
QUIET_OPTION = click.option(
    "-q",
    "--quiet",
    is_flag=True,
    help="Report only what fails (no warnings, no progress); the exit code is the same.",
)


def codes_option(codes: Collection[str], what: str) -> Callable[[F], F]:
    """``--ignore CODE`` (repeatable), CODE one of ``codes``: leave ``what`` of that code
    out."""

    def known(_ctx: click.Context, _param: click.Parameter, value: tuple[str, ...]) -> Any:
        given = tuple(code.upper() for code in value)
        for code in given:
            if code not in codes:
                raise click.BadParameter(
                    f"{code!r} is not a finding code (the codes: docs/findings.md)"
                )
        return given

    return click.option(
        "--ignore",
        "ignore",
        multiple=True,
        metavar="CODE",
        callback=known,
        help=f"Leave out {what} of CODE, e.g. SC110 (repeatable; docs/findings.md).",
    )


def tolerance_options(when: str = "", *, by_type: bool = False) -> Callable[[F], F]:
    """``--rtol`` and ``--atol`` of the comparison with one device; ``when``: a note on when
    they apply; ``by_type``: no fixed default, the outputs' element type decides (verify's,
    runtime/settings.py's ``default_tolerances``)."""

    def decorate(command: F) -> F:
        for name, default, kind in (("--atol", 1e-5, "Absolute"), ("--rtol", 1e-4, "Relative")):
            help = f"{kind} tolerance of the comparison with one device{when}."
            if by_type:
                help += f"  [default: by the outputs' type; {default:g} for float32]"
            command = click.option(
                name,
                type=float,
                default=None if by_type else default,
                show_default=not by_type,
                help=help,
            )(command)
        return command

    return decorate


def defaulted(name: str, kind: Any, default: Any, help: str) -> Callable[[F], F]:
    """An option whose help shows its default."""
    return click.option(name, type=kind, default=default, show_default=True, help=help)
