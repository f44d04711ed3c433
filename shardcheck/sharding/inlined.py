"""The extension's inlined functions: attention inside the model-local functions the graph calls.

An export that writes each block as a call of a model-local function (torch.onnx.export's
``export_modules_as_functions``) holds its attention in the functions' bodies, where no hint
can name a tensor (analysis/hidden.py): the Polygraphy-format hints shard none of it. The
extension names the functions (``inlined_functions``), and every command that reads it first
inlines them into the graph with ``onnx.inliner``, which computes what the calls did and names
the inlined nodes and tensors the same on every run: the extension's hints name tensors of that
graph, and the multi-device model ``shardcheck shard`` writes is made from it.
"""

from __future__ import annotations

from shardcheck.errors import HintsMismatchError, ModelError
from shardcheck.graph import protos
from shardcheck.graph.index import GraphIndex
from shardcheck.hints.model import ShardHints
from shardcheck.wording import one_line

FunctionId = tuple[str, str]  # (domain, name), as a call node's (domain, op_type)


def local_functions(model: protos.ModelProto) -> tuple[FunctionId, ...]:
    """The model's local functions, in the model's order."""
    return tuple((function.domain, function.name) for function in model.functions)


def inlined_index(index: GraphIndex, functions: tuple[FunctionId, ...]) -> GraphIndex:
    """The index of the model with ``functions`` inlined (every call of them, at any depth of
    the graph); the weights are the model's, where they were."""
    import onnx.inliner

    try:
        model = onnx.inliner.inline_selected_functions(index.model, [list(f) for f in functions])
    except Exception as error:  # onnx's own errors have no common base to catch
        raise ModelError(
            f"{index.source}: its model-local functions cannot be inlined: {one_line(str(error))}"
        ) from None
    inlined = GraphIndex(model, index.source, lent_weights=index.lent_weights)
    inlined.inlined_functions = index.inlined_functions + functions
    return inlined


def planned_index(index: GraphIndex, hints: ShardHints, hints_source: str) -> GraphIndex:
    """The index of the graph ``hints`` name tensors of: ``index``'s, with the functions an
    extension names inlined (``index`` itself where it names none, or where they are inlined
    already). HintsMismatchError where one is not a local function of the model."""
    named = hints.lengths.inlined if hints.lengths is not None else ()
    wanted = tuple(function for function in named if function not in index.inlined_functions)
    if not wanted:
        return index
    present = set(local_functions(index.model))
    for domain, name in wanted:
        if (domain, name) not in present:
            raise HintsMismatchError(
                f"{hints_source}: inlined_functions: {domain + '.' if domain else ''}{name} is "
                f"not a model-local function of {index.source}; regenerate the extension with "
                "'shardcheck gen' for this model"
            )
    return inlined_index(index, wanted)
