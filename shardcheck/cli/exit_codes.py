"""What each command's exit codes mean, listed at the end of its ``--help``.

Every command follows diff(1): 0 success, 1 findings or differences, 2 bad input; the
interrupted and stopped ones (130, 141, 143) are in docs/commands.md.
"""

from __future__ import annotations

BAD_INPUT = "the input could not be used (bad input); one error line names the file"

EXIT_CODES: dict[str, dict[int, str]] = {
    "check": {
        0: "every model matches its golden",
        1: "a model differs, has no golden or fails, or a golden is stale",
        2: "the manifest could not be used",
    },
    "diff": {0: "equal", 1: "different", 2: BAD_INPUT},
    "explain": {0: "the plan is written", 2: BAD_INPUT},
    "fmt": {
        0: "written (with --check: already in canonical form)",
        1: "with --check: not in canonical form",
        2: BAD_INPUT,
    },
    "gen": {
        0: "the hints are written",
        1: "no correct file can be written (layers need different K indices)",
        2: BAD_INPUT,
    },
    "shard": {0: "the multi-device model is written", 2: BAD_INPUT},
    "simulate": {
        0: "every rank's outputs match the single-device run",
        1: "they differ",
        2: BAD_INPUT,
    },
    "verify": {
        0: "no finding is an error (with --strict: nor a warning)",
        1: "an error finding (with --strict: or a warning)",
        2: BAD_INPUT,
    },
}


def exit_codes_epilog(command: str) -> str | None:
    """The ``Exit codes:`` section of ``command``'s help (click keeps a ``\\b`` paragraph's
    lines as they are)."""
    codes = EXIT_CODES.get(command)
    if codes is None:
        return None
    lines = [f"  {code}  {meaning}" for code, meaning in sorted(codes.items())]
    return "\b\nExit codes:\n" + "\n".join(lines)
