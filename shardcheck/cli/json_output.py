"""``--format json`` for every command: the JSON a command prints, and its errors as JSON.

Under ``--format json`` an error is a JSON object on stdout, ``{"ok": false, "error":
"FILE: what is wrong"}``, besides its line on stderr, and the exit code is the same (2 for bad
input): a program reading stdout always gets JSON. Values a command does not have are null.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

_state = {"errors_as_json": False}


def wants_json(args: Sequence[str]) -> bool:
    """Whether the command line asks for ``--format json`` (before any ``--``)."""
    for position, token in enumerate(args):
        if token == "--":
            return False
        if token == "--format=json":
            return True
        if token == "--format" and position + 1 < len(args) and args[position + 1] == "json":
            return True
    return False


def errors_as_json(enabled: bool) -> None:
    """Whether the errors of this run are also written to stdout as JSON (cli.main sets it)."""
    _state["errors_as_json"] = enabled


def echo_error_json(message: str) -> None:
    """The error as a JSON object on stdout, when this run's errors are JSON."""
    if _state["errors_as_json"]:
        echo_json({"ok": False, "error": message})


def document(value: Any) -> str:
    """``value`` as the commands print JSON: 2-space indent, a final newline."""
    return json.dumps(value, indent=2) + "\n"


def echo_json(value: Any) -> None:
    click.echo(document(value), nl=False)
