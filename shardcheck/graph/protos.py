"""ONNX's protobuf message classes and its checker, without importing the ``onnx`` package.

``import onnx`` takes a fifth of a second or more (it imports numpy, ml_dtypes, protobuf's JSON
support and more); the message classes alone take a few hundredths, and onnx's compiled
extension, which holds the checker, a few thousandths. Reading a graph needs only the classes
and checking it only the extension, so ``gen`` loads ONNX's generated module
``onnx/onnx_ml_pb2.py`` and the extension ``onnx/onnx_cpp2py_export*.so`` by themselves, under
their own names: when the ``onnx`` package is imported later (by verify, or a caller), it finds
them already loaded and uses the very same classes. If a module cannot be loaded so (a layout
this code does not know), ``onnx`` is imported as usual.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

_PB2 = "onnx.onnx_ml_pb2"
_EXTENSION = "onnx.onnx_cpp2py_export"
# The largest serialized model onnx's checker takes (protobuf's limit, as onnx.checker has it).
MAX_CHECKED_BYTES = 2**31


# The modules loaded here, kept apart from sys.modules: code that restores a snapshot of
# sys.modules (pytest's in-process runs do) drops them from it, and the compiled extension
# must not run twice in one process (nanobind aborts on its second registration).
# The extension registers its submodules (onnx.onnx_cpp2py_export.defs ...) there too.
_LOADED_ALONE: dict[str, dict[str, ModuleType]] = {}


def _load_alone(name: str, file_names: Iterable[str], expected: str) -> ModuleType | None:
    """``name`` (a module of the onnx package) loaded from the first of ``file_names`` in the
    package's directory, without running the package's ``__init__``; None when it cannot be
    (the package is already imported, or laid out otherwise) or lacks ``expected``."""
    _restore_loaded_alone()
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    if "onnx" in sys.modules:
        return None
    try:
        package = importlib.util.find_spec("onnx")
        locations = package.submodule_search_locations if package else None
        if not locations:
            return None
        directory = Path(next(iter(locations)))
        path = next((directory / f for f in file_names if (directory / f).is_file()), None)
        spec = None if path is None else importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        if hasattr(module, expected):
            _LOADED_ALONE[name] = {
                key: value
                for key, value in sys.modules.items()
                if key == name or key.startswith(f"{name}.")
            }
            return module
        del sys.modules[name]
    except (ImportError, OSError):
        pass
    return None


def _restore_loaded_alone() -> None:
    for modules in _LOADED_ALONE.values():
        for module_name, module in modules.items():
            sys.modules.setdefault(module_name, module)


def _load_messages() -> ModuleType:
    module = _load_alone(_PB2, ("onnx_ml_pb2.py",), "ModelProto")
    if module is not None:
        return module
    import onnx

    return onnx.onnx_ml_pb2


def checker() -> ModuleType:
    """onnx's C++ checker (``onnx.checker`` calls it): ``check_model(serialized, full_check,
    skip_opset_compatibility_check, check_custom_domain)`` and its ``ValidationError``. Loaded
    with the extension alone when the ``onnx`` package is not imported yet."""
    extension = _load_alone(
        _EXTENSION,
        (f"onnx_cpp2py_export{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES),
        "checker",
    )
    if extension is None:
        extension = full_onnx().onnx_cpp2py_export
    return extension.checker


def full_onnx() -> ModuleType:
    """The ``onnx`` package itself (helpers, serialization formats), imported now."""
    _restore_loaded_alone()  # else importing the package would run the extension again
    import onnx

    # The package binds its submodules as attributes when it imports them; one that was
    # already loaded (above) is found in sys.modules instead, and has to be bound here.
    for attribute, name in (("onnx_ml_pb2", _PB2), ("onnx_cpp2py_export", _EXTENSION)):
        if getattr(onnx, attribute, None) is None and name in sys.modules:
            setattr(onnx, attribute, sys.modules[name])
    return onnx


_messages = _load_messages()
ModelProto = _messages.ModelProto
GraphProto = _messages.GraphProto
NodeProto = _messages.NodeProto
TensorProto = _messages.TensorProto
AttributeProto = _messages.AttributeProto
ValueInfoProto = _messages.ValueInfoProto
