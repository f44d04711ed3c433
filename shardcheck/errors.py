"""Error types. Every error a user can cause is a ShardcheckError with a one-line message."""

from __future__ import annotations


class ShardcheckError(Exception):
    """Root of shardcheck's errors: the message is what the user reads, on one line."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InputError(ShardcheckError):
    """An input (model, hints file, manifest, option) cannot be used. Exit code 2."""


class HintsFormatError(InputError):
    """A hints file does not have the shape or types of a hints file."""

    def __init__(self, source: str, path: str, problem: str) -> None:
        location = f"{source}: {path}" if path else source
        super().__init__(f"{location}: {problem}")
        self.source = source
        self.path = path
        self.problem = problem


class HintsMismatchError(InputError):
    """Hints read without fault that do not fit the model (a tensor it lacks, an axis past a
    tensor's rank) or that shard does not write (TP): shard refuses them (exit 2); verify's
    simulation reports them (SC203)."""


class ModelError(InputError):
    """An ONNX model cannot be read or is not usable."""


class OutputError(InputError):
    """An output file cannot be written."""


class AnalysisError(ShardcheckError):
    """The model was read, but no correct result can be written (e.g. layers that disagree).

    Exit code 1, like a finding: the input is fine, the model is the problem.
    """

    exit_code = 1
