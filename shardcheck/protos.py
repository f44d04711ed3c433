"""ONNX's protobuf message classes, without importing the ``onnx`` package for them.

``import onnx`` takes a fifth of a second (it imports numpy, ml_dtypes, protobuf's JSON support
and more); the message classes alone take a few hundredths. Reading a graph needs only the
classes, so ``gen`` loads ONNX's generated module ``onnx/onnx_ml_pb2.py`` by itself, under its
own name: when the ``onnx`` package is imported later (to run the checker, or by verify), it
finds that module already loaded and uses the very same classes. If the module cannot be loaded
so (a layout this code does not know), ``onnx`` is imported as usual.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

_PB2 = "onnx.onnx_ml_pb2"


def _load_messages() -> ModuleType:
    loaded = sys.modules.get(_PB2)
    if loaded is not None:
        return loaded
    if "onnx" not in sys.modules:
        try:
            package = importlib.util.find_spec("onnx")
            locations = package.submodule_search_locations if package else None
            if locations:
                spec = importlib.util.spec_from_file_location(
                    _PB2, f"{next(iter(locations))}/onnx_ml_pb2.py"
                )
                if spec is not None and spec.loader is not None:
                    module = importlib.util.module_from_spec(spec)
                    sys.modules[_PB2] = module
                    try:
                        spec.loader.exec_module(module)
                    except BaseException:
                        del sys.modules[_PB2]
                        raise
                    if hasattr(module, "ModelProto"):
                        return module
                    del sys.modules[_PB2]
        except (ImportError, OSError):
            pass
    import onnx

    return onnx.onnx_ml_pb2


def full_onnx() -> ModuleType:
    """The ``onnx`` package itself (checker, helpers, serialization formats), imported now."""
    import onnx

    # The package binds its submodules as attributes when it imports them; one that was
    # already loaded (above) is found in sys.modules instead, and has to be bound here.
    if getattr(onnx, "onnx_ml_pb2", None) is None:
        onnx.onnx_ml_pb2 = sys.modules[_PB2]
    return onnx


_messages = _load_messages()
ModelProto = _messages.ModelProto
GraphProto = _messages.GraphProto
NodeProto = _messages.NodeProto
TensorProto = _messages.TensorProto
AttributeProto = _messages.AttributeProto
ValueInfoProto = _messages.ValueInfoProto
