"""The gating manifest: which models to check, with which gen options, against which goldens.

The manifest is the ``[tool.shardcheck]`` table of a TOML file: ``pyproject.toml`` or a
``shardcheck.toml`` that holds the very same table (so a manifest moves between the two files
unchanged). Paths in it are relative to the directory of that file. Everything is validated
here; each error is one line naming the file and the key, e.g.
``pyproject.toml: tool.shardcheck.models[2].golden: missing``.
"""

from __future__ import annotations

import math
import os
import re
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardcheck.errors import InputError
from shardcheck.fsio import nul_problem, why_unreadable
from shardcheck.generation.options import DEFAULT_SEQ_LENS, GenOptions, is_integer
from shardcheck.wording import listed, shown

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MANIFEST_NAMES = ("shardcheck.toml", "pyproject.toml")
TABLE = "tool.shardcheck"
TOP_KEYS = ("golden-dir", "models", "strict", "timeout")
MODEL_KEYS = (
    "name",
    "path",
    "golden",
    "gen",
    "verify",
    "ranks",
    "seq-lens",
    "seq-len",
    "rtol",
    "atol",
    "strict",
    "timeout",
)
# How long one model's verify may run, in seconds, unless the manifest says otherwise: long
# enough for a model of a few GiB on a CI runner, short enough that a hung run fails the job.
DEFAULT_VERIFY_TIMEOUT = 600.0
# The longest golden file name: its temporary file, ".<name>.<8 characters>.tmp", must fit in
# the 255 bytes a file name may have.
MAX_GOLDEN_NAME_BYTES = 240
NAME_MAX = 255
# Names become pytest node names and report keys: no spaces, no "::", no "/".
_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")


@dataclass(frozen=True)
class ModelEntry:
    """One model of the manifest. ``*_text`` are the paths as written, for messages."""

    name: str
    position: int
    path_text: str
    golden_text: str
    model_path: Path
    golden_path: Path
    gen: GenOptions
    verify: bool = False
    ranks: int | None = None
    seq_lens: tuple[int, ...] | None = None
    # A sequence dim's own lengths, one per run of seq_lens (verify's --seq-len NAME=L1,L2):
    # an encoder-decoder's target beside its source.
    seq_len_of: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # verify's simulation tolerances; None: by the outputs' element type.
    rtol: float | None = None
    atol: float | None = None
    strict: bool = False  # gen's warnings fail the model
    timeout: float = DEFAULT_VERIFY_TIMEOUT  # seconds verify may run

    @property
    def where(self) -> str:
        return f"{TABLE}.models[{self.position}]"


@dataclass(frozen=True)
class Manifest:
    source: Path
    root: Path
    models: tuple[ModelEntry, ...]
    golden_dir: Path | None = None

    def display(self, path: Path) -> str:
        """``path`` relative to the manifest's directory, with / separators."""
        return Path(os.path.relpath(path, self.root)).as_posix()


def find_manifest(directory: str | os.PathLike[str] = ".") -> Path:
    """The manifest of ``directory``: in it or the nearest parent directory, a
    ``shardcheck.toml``, or else a ``pyproject.toml`` with a [tool.shardcheck] table (as pytest
    and ruff find their configuration). The paths in it stay relative to its own directory."""
    base = Path(directory)
    levels = len(Path(os.path.abspath(base)).parents)
    nearest_pyproject = None
    # Spelled relative to ``directory`` (../shardcheck.toml), as the user would.
    for folder in (base, *(base.joinpath(*[".."] * up) for up in range(1, levels + 1))):
        candidate = folder / MANIFEST_NAMES[0]
        if candidate.is_file():
            return candidate
        candidate = folder / MANIFEST_NAMES[1]
        if candidate.is_file() and _mentions_the_table(candidate):
            return candidate
        if candidate.is_file() and nearest_pyproject is None:
            nearest_pyproject = candidate
    if nearest_pyproject is not None:
        return nearest_pyproject  # load_manifest says that it has no table
    raise InputError(
        f"{base}: no manifest: no shardcheck.toml, nor a pyproject.toml with a [{TABLE}] "
        "table, in this directory or any parent"
    )


def _mentions_the_table(pyproject: Path) -> bool:
    """Whether a pyproject.toml may hold the manifest (a project's own pyproject without one is
    passed over for a parent's). A mention is enough: load_manifest says what is wrong."""
    try:
        return TABLE.encode() in pyproject.read_bytes()
    except OSError:
        return True


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and validate the manifest in the TOML file ``path``."""
    file = Path(path)
    if nul_problem(path) is not None:
        raise InputError(f"{os.fspath(path)!r}: {nul_problem(path)}")
    if os.fspath(path) == "-" and not file.exists():
        raise InputError(
            "-: reading the manifest from standard input is not supported; give its path"
        )
    problem = _why_not_a_manifest_file(file)
    if problem:
        raise InputError(f"{file}: {problem}")
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise InputError(f"{file}: cannot read: {exc.strerror or exc}") from None
    if data.startswith(b"\xef\xbb\xbf"):
        raise InputError(
            f"{file}: begins with a UTF-8 byte-order mark, which TOML does not allow; "
            "save the file without it"
        )
    try:
        document = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(f"{file}: not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{file}: not valid TOML ({exc})") from None
    except RecursionError:
        raise InputError(f"{file}: not a usable TOML file: nested too deeply") from None
    return parse_manifest(document, file)


def _why_not_a_manifest_file(file: Path) -> str | None:
    """Why ``file`` cannot be read as the manifest. Only a regular file can: standard input,
    a pipe or a device would be read once, or block."""
    if _names_a_stream(file):
        return "is standard input or another open stream, not a file; give the manifest's path"
    if os.path.islink(file) and not file.exists():
        return f"no such file (a link to {os.readlink(file)!r}, which does not exist)"
    problem = why_unreadable(file, "a TOML file")
    if problem:
        return problem
    if not file.is_file():
        return "is not a regular file (a pipe or a device); give the manifest's path"
    return None


def _names_a_stream(file: Path) -> bool:
    """Whether ``file`` is, or links through, /dev/stdin (stdout, stderr), /dev/fd/N or
    /proc/*/fd/N: a file descriptor of a process, which may be a pipe, a terminal or closed."""
    spelled = os.path.abspath(file)
    for _ in range(40):  # the kernel's own limit on links followed
        parts = Path(spelled).parts
        if spelled in ("/dev/stdin", "/dev/stdout", "/dev/stderr") or spelled.startswith(
            "/dev/fd/"
        ):
            return True
        if len(parts) >= 4 and parts[1] == "proc" and parts[3] == "fd":
            return True
        if not os.path.islink(spelled):
            return False
        spelled = os.path.join(os.path.dirname(spelled), os.readlink(spelled))
    return False


def parse_manifest(document: Mapping[str, Any], source: Path) -> Manifest:
    """Validate a decoded TOML document; paths resolve against ``source``'s directory."""
    table = _normalised_keys(_shardcheck_table(document, source), TOP_KEYS, source, TABLE)
    root = source.parent
    golden_dir_text = _optional_path(table, "golden-dir", source, TABLE)
    if golden_dir_text is not None:
        _refuse_outside(root, golden_dir_text, source, f"{TABLE}.golden-dir")
    defaults = {
        "strict": _strict(table, False, source, TABLE),
        "timeout": _timeout(table, DEFAULT_VERIFY_TIMEOUT, source, TABLE),
    }
    if "models" not in table:
        raise _error(source, f"{TABLE}.models", f"missing (list each model as [[{TABLE}.models]])")
    raw_models = table["models"]
    if not isinstance(raw_models, list) or not raw_models:
        raise _error(
            source,
            f"{TABLE}.models",
            f"expected one or more [[{TABLE}.models]] tables, got {shown(raw_models)}",
        )
    models = tuple(
        _model(raw, position, source, root, defaults) for position, raw in enumerate(raw_models)
    )
    _check_unique(models, source)
    golden_dir = None
    if golden_dir_text is not None:
        golden_dir = root / golden_dir_text
        _check_golden_dir(golden_dir, golden_dir_text, models, source)
    return Manifest(source=source, root=root, models=models, golden_dir=golden_dir)


def _check_golden_dir(
    golden_dir: Path, text: str, models: tuple[ModelEntry, ...], source: Path
) -> None:
    """A golden-dir that is a file, or is missing with none of the goldens in it (a misspelt
    path), would silently turn the stale-golden check off."""
    where = f"{TABLE}.golden-dir"
    if golden_dir.exists() and not golden_dir.is_dir():
        raise _error(source, where, f"{text!r} is not a directory")
    inside = any(
        entry.golden_path.resolve().is_relative_to(golden_dir.resolve()) for entry in models
    )
    if not golden_dir.exists() and not inside:
        raise _error(
            source, where, f"{text!r} does not exist and holds none of the goldens; check the path"
        )


def _shardcheck_table(document: Mapping[str, Any], source: Path) -> Mapping[str, Any]:
    tool = document.get("tool")
    if tool is not None and not isinstance(tool, dict):
        raise _error(source, "tool", f"expected a table, got {shown(tool)}")
    table = (tool or {}).get("shardcheck")
    if table is None:
        found = [key for key in document if key in TOP_KEYS]
        hint = f" (found top-level {', '.join(found)}: put them under [{TABLE}])" if found else ""
        raise InputError(f"{source}: no [{TABLE}] table{hint}; see docs/gating.md")
    if not isinstance(table, dict):
        raise _error(source, TABLE, f"expected a table, got {shown(table)}")
    return table


def _model(
    raw: Any, position: int, source: Path, root: Path, defaults: Mapping[str, Any]
) -> ModelEntry:
    where = f"{TABLE}.models[{position}]"
    if not isinstance(raw, dict):
        raise _error(source, where, f"expected a table, got {shown(raw)}")
    raw = _normalised_keys(raw, MODEL_KEYS, source, where)
    path_text = _required_path(raw, "path", source, where)
    golden_text = _required_path(raw, "golden", source, where)
    if not golden_text.endswith(".json"):
        raise _error(source, f"{where}.golden", f"expected a .json file, got {shown(golden_text)}")
    _refuse_outside(root, golden_text, source, f"{where}.golden")
    if len(Path(golden_text).name.encode("utf-8", "surrogateescape")) > MAX_GOLDEN_NAME_BYTES:
        raise _error(
            source,
            f"{where}.golden",
            f"the file name is longer than {MAX_GOLDEN_NAME_BYTES} bytes; give a shorter one",
        )
    name = _name(raw, path_text, source, where)
    gen = raw.get("gen", {})
    if not isinstance(gen, dict):
        raise _error(source, f"{where}.gen", f"expected a table of gen options, got {shown(gen)}")
    verify = raw.get("verify", False)
    if not isinstance(verify, bool):
        raise _error(source, f"{where}.verify", f"expected true or false, got {shown(verify)}")
    entry = ModelEntry(
        name=name,
        position=position,
        path_text=path_text,
        golden_text=golden_text,
        model_path=root / path_text,
        golden_path=root / golden_text,
        gen=GenOptions.from_mapping(gen, source=f"{source}: {where}.gen"),
        verify=verify,
        ranks=_ranks(raw, source, where),
        seq_lens=_seq_lens(raw, source, where),
        seq_len_of=_own_lengths(raw, source, where),
        rtol=_tolerance(raw, "rtol", source, where),
        atol=_tolerance(raw, "atol", source, where),
        strict=_strict(raw, defaults["strict"], source, where),
        timeout=_timeout(raw, defaults["timeout"], source, where),
    )
    _check_own_lengths(entry, source, where)
    _check_ranks_divide(entry, source, where)
    return entry


def _name(raw: Mapping[str, Any], path_text: str, source: Path, where: str) -> str:
    if "name" not in raw:
        name = Path(path_text).stem
        if not _NAME.match(name):
            raise _error(
                source,
                f"{where}.name",
                f"the file stem {shown(name)} cannot be a name (letters, digits, _ . + - only); "
                "set name",
            )
        return name
    name = raw["name"]
    if not isinstance(name, str) or not _NAME.match(name):
        raise _error(
            source,
            f"{where}.name",
            f"expected a name of letters, digits, _ . + - (no spaces), got {shown(name)}",
        )
    return name


def _strict(raw: Mapping[str, Any], default: bool, source: Path, where: str) -> bool:
    strict = raw.get("strict", default)
    if not isinstance(strict, bool):
        raise _error(source, f"{where}.strict", f"expected true or false, got {shown(strict)}")
    return strict


def _timeout(raw: Mapping[str, Any], default: float, source: Path, where: str) -> float:
    timeout = raw.get("timeout", default)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout <= threading.TIMEOUT_MAX
    ):
        raise _error(
            source,
            f"{where}.timeout",
            f"expected a positive number of seconds, got {shown(timeout)}",
        )
    return float(timeout)


def _refuse_outside(root: Path, text: str, source: Path, where: str) -> None:
    """A golden (or golden-dir) outside the manifest's directory would let a manifest, or
    --update, write over any file the user can write: refused, links followed."""
    if Path(text).is_absolute():
        raise _error(
            source,
            where,
            f"{shown(text)} is an absolute path; give a path inside the manifest's directory",
        )
    base = os.path.realpath(root)
    real = os.path.realpath(root / text)
    if not Path(real).is_relative_to(base):
        raise _error(
            source,
            where,
            f"{shown(text)} resolves outside the manifest's directory (to {real}); "
            "give a path inside it",
        )


def _ranks(raw: Mapping[str, Any], source: Path, where: str) -> int | None:
    ranks = raw.get("ranks")
    if ranks is None:
        return None
    if not is_integer(ranks) or ranks < 1:
        raise _error(source, f"{where}.ranks", f"expected an integer >= 1, got {shown(ranks)}")
    return ranks


def _tolerance(raw: Mapping[str, Any], key: str, source: Path, where: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise _error(source, f"{where}.{key}", f"expected a finite number >= 0, got {shown(value)}")
    return float(value)


def _seq_lens(raw: Mapping[str, Any], source: Path, where: str) -> tuple[int, ...] | None:
    seq_lens = raw.get("seq-lens")
    if seq_lens is None:
        return None
    if (
        not isinstance(seq_lens, list)
        or not all(is_integer(n) and n >= 1 for n in seq_lens)
        or len(set(seq_lens)) < 2
    ):
        # verify tells the sequence axis by the lengths it changes with: two at least.
        raise _error(
            source,
            f"{where}.seq-lens",
            f"expected a list of two or more different integers >= 1, got {shown(seq_lens)}",
        )
    return tuple(seq_lens)


def _own_lengths(
    raw: Mapping[str, Any], source: Path, where: str
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``seq-len = { target = [4, 8] }``: each dim's own lengths, a list as seq-lens is (their
    count is checked against seq-lens by ``_check_own_lengths``)."""
    table = raw.get("seq-len")
    if table is None:
        return ()
    if not isinstance(table, dict) or not table:
        raise _error(
            source,
            f"{where}.seq-len",
            "expected a table of sequence dims and their own lengths, e.g. "
            f"{{ target = [4, 8] }}, got {shown(table)}",
        )
    for name, lengths in table.items():
        if (
            not isinstance(lengths, list)
            or not all(is_integer(n) and n >= 1 for n in lengths)
            or len(set(lengths)) != len(lengths)
        ):
            raise _error(
                source,
                f"{where}.seq-len.{name}",
                f"expected a list of different integers >= 1, got {shown(lengths)}",
            )
    return tuple((name, tuple(lengths)) for name, lengths in table.items())


def _check_own_lengths(entry: ModelEntry, source: Path, where: str) -> None:
    """One own length per run of seq-lens, in its order: verify runs them together."""
    seq_lens = entry.seq_lens or DEFAULT_SEQ_LENS
    given = "" if entry.seq_lens else " (verify's default lengths)"
    for name, lengths in entry.seq_len_of:
        if len(lengths) != len(seq_lens):
            raise _error(
                source,
                f"{where}.seq-len.{name}",
                f"expected one length per run of seq-lens {shown(list(seq_lens))}{given}, "
                f"{len(seq_lens)} in its order, got {shown(list(lengths))}",
            )


def _check_ranks_divide(entry: ModelEntry, source: Path, where: str) -> None:
    if entry.ranks is None:
        return
    for name, lengths in entry.seq_len_of:
        bad = [str(n) for n in lengths if n % entry.ranks]
        if bad:
            raise _error(
                source,
                f"{where}.seq-len.{name}",
                f"{listed(bad)} {'is' if len(bad) == 1 else 'are'} not a multiple of ranks "
                f"({entry.ranks}): each rank gets an equal part of the sequence",
            )
    seq_lens = entry.seq_lens or DEFAULT_SEQ_LENS
    bad = [str(n) for n in seq_lens if n % entry.ranks]
    if bad:
        key, given = (
            ("seq-lens", "") if entry.seq_lens else ("ranks", " (verify's default lengths)")
        )
        raise _error(
            source,
            f"{where}.{key}",
            f"{listed(bad)}{given} {'is' if len(bad) == 1 else 'are'} not a multiple of ranks "
            f"({entry.ranks}): each rank gets an equal part of the sequence",
        )


def _check_unique(models: tuple[ModelEntry, ...], source: Path) -> None:
    names: dict[str, ModelEntry] = {}
    goldens: dict[Path, ModelEntry] = {}
    for entry in models:
        if entry.name in names:
            other = names[entry.name]
            raise _error(
                source,
                f"{entry.where}.name",
                f"duplicate name {shown(entry.name)} (also {other.where}); set distinct names",
            )
        names[entry.name] = entry
        golden = entry.golden_path.resolve()
        if golden in goldens:
            other = goldens[golden]
            raise _error(
                source,
                f"{entry.where}.golden",
                f"{entry.golden_text} is already the golden of {other.where} ({other.name})",
            )
        goldens[golden] = entry
    inputs = {source.resolve(): "the manifest itself"}
    inputs.update((entry.model_path.resolve(), f"the model of {entry.where}") for entry in models)
    for entry in models:
        what = inputs.get(entry.golden_path.resolve())
        if what is not None:
            raise _error(
                source,
                f"{entry.where}.golden",
                f"{shown(entry.golden_text)} is {what}; give the golden a file of its own",
            )


def _normalised_keys(
    table: Mapping[str, Any], known: tuple[str, ...], source: Path, where: str
) -> dict[str, Any]:
    """``table`` with its keys spelled with - (TOML style) where the file may use - or _.

    An unknown key, or one key in both spellings, is an error.
    """
    result: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in table.items():
        canonical = key.replace("_", "-")
        if canonical not in known:
            raise _error(source, f"{where}.{key}", f"unknown key (known keys: {', '.join(known)})")
        if canonical in result:
            raise _error(source, f"{where}.{key}", f"given twice (also as {spelled[canonical]})")
        result[canonical] = value
        spelled[canonical] = key
    return result


def _required_path(table: Mapping[str, Any], key: str, source: Path, where: str) -> str:
    if key not in table:
        raise _error(source, f"{where}.{key}", "missing")
    return _path_text(table[key], source, f"{where}.{key}")


def _optional_path(table: Mapping[str, Any], key: str, source: Path, where: str) -> str | None:
    return None if key not in table else _path_text(table[key], source, f"{where}.{key}")


def _path_text(value: Any, source: Path, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _error(source, where, f"expected a path (a non-empty string), got {shown(value)}")
    if nul_problem(value) is not None:
        raise _error(source, where, f"{shown(value)}: {nul_problem(value)}")
    if any(len(part.encode("utf-8", "surrogateescape")) > NAME_MAX for part in Path(value).parts):
        raise _error(
            source, where, f"{shown(value)}: a file name in it is longer than {NAME_MAX} bytes"
        )
    return value


def _error(source: Path, where: str, problem: str) -> InputError:
    return InputError(f"{source}: {where}: {problem}")
