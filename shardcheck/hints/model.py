"""What a hints file says: the collectives, the attention layers, the tensors to scatter and
gather, as frozen dataclasses (their JSON form is ``codec.py``'s)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

PARALLELISMS = ("CP", "TP")
REDUCE_OPS = ("sum", "prod", "min", "max", "avg")
# ONNX puts no bound on rank; TensorRT stops at 8. Anything past this is a typo, not a model.
MAX_AXIS = 64


@dataclass(frozen=True)
class DistCollective:
    """Settings shared by every collective that the shard inserts."""

    group_size: int = 0
    root: int = -1
    nb_rank: int = 1
    groups: tuple[int, ...] = ()
    reduce_op: str = "max"


@dataclass(frozen=True)
class FusedAttention:
    """Replace an attention layer with a fused attention op (``--cp-type fused``)."""

    is_causal: bool
    q_shuffle: tuple[int, ...] | None = None
    k_shuffle: tuple[int, ...] | None = None
    v_shuffle: tuple[int, ...] | None = None
    nb_rank: int = 1


def is_permutation(axes: Sequence[int]) -> bool:
    """Whether ``axes`` holds each axis from 0 to its length - 1 once (a fused shuffle must)."""
    return sorted(axes) == list(range(len(axes)))


@dataclass(frozen=True)
class ShardTensor:
    """A tensor to scatter (input) or gather (output) along ``seq_len_idx``."""

    name: str
    seq_len_idx: int
    rank: int | None = None


@dataclass(frozen=True)
class AttentionLayerHint:
    """An attention layer, named by its Q tensor."""

    q: str
    gather_kv: bool
    gather_q: bool
    replace: FusedAttention | None = None


@dataclass(frozen=True)
class ReaderGather:
    """A tensor of a layer's K or V on its way to the layer's gather, all-gathered along
    ``seq_len_idx`` for ``nodes`` alone, which read it beside the layer (DeBERTa's
    position-to-content scores, ``frontier/kv_readers.py``); every other consumer keeps the
    rank's slice."""

    name: str
    seq_len_idx: int
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class LengthReads:
    """shardcheck's extension to the hints (``extension.py``): the nodes whose shape inputs
    ``shardcheck shard`` computes from the whole length of the sequence (``whole``: they
    compute whole tensors, as positions and masks, read off a slice's Shape) or from a rank's
    length (``rank``: they run on slices, sized by a whole tensor's Shape). The Polygraphy
    format cannot say it: its shard gives a Shape what its tensor's other consumers read.
    ``traced``: the Reshapes that hold the length a TorchScript trace ran at, which the shard
    first makes compute it from their input (``sharding/traced.py``). ``for_output``: the
    hinted outputs whose all-gather feeds the graph output only (hidden states or attention
    probabilities given out): their other consumers keep the rank's slice. ``inlined``: the
    model-local functions, as (domain, name), that every command inlines into the graph before
    it reads the hints, which name that graph's tensors (``sharding/inlined.py``).
    ``for_readers``: K and V gathered for the nodes that read them beside their layer."""

    whole: tuple[str, ...] = ()
    rank: tuple[str, ...] = ()
    traced: tuple[str, ...] = ()
    for_output: tuple[str, ...] = ()
    inlined: tuple[tuple[str, str], ...] = ()
    for_readers: tuple[ReaderGather, ...] = ()


@dataclass(frozen=True)
class ShardHints:
    """A whole hints file. ``lengths``, the extension, is never written to the Polygraphy
    format (``codec.py``): only to an extension file (``extension.py``)."""

    parallelism: str = "CP"
    attention_layers: tuple[AttentionLayerHint, ...] = ()
    dist_collectives: DistCollective = field(default_factory=DistCollective)
    inputs: tuple[ShardTensor, ...] = ()
    outputs: tuple[ShardTensor, ...] = ()
    k_seq_len_idx: int = 0
    v_seq_len_idx: int = 0
    kv_rank: int | None = None
    lengths: LengthReads | None = None

    def with_changes(self, **changes: Any) -> ShardHints:
        return replace(self, **changes)
