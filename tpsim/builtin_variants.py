"""The variants of tpsim's own layers (:mod:`tpsim.layers`), as ``tpsim check tpsim.layers`` checks them.

The layer core must not import the harness (DESIGN.md: the same ``ColumnParallelLinear`` runs in a
real training job with no tpsim machinery around it), so its variant descriptions live here, and
the target resolver maps the bare target ``tpsim.layers`` to this module.

Every builder constructs the layer exactly as a user would (with the tp ``group`` and ``dtype``);
the generic loader then overwrites the layer's own initialisation with the master shards, by the
default placements: column weight/bias ``S(0)``, row weight ``S(1)`` and bias ``R``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from tpsim.attention_variant import AttentionVariant, from_dense_builder
from tpsim.layers import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
)
from tpsim.layers.linear import skip_init
from tpsim.module_variant import ModuleVariant
from tpsim.variant import Variant
from tpsim.vocab_variant import CrossEntropyVariant, EmbeddingVariant

__all__ = [
    "TPSIM_MODULES",
    "TPSIM_VARIANTS",
    "TPSIM_VOCAB",
    "attention",
    "attention_sequence_parallel",
    "column",
    "column_gate_up",
    "column_gathered",
    "column_qkv_gathered",
    "column_qkv_gqa",
    "column_sequence_parallel",
    "mlp_gelu",
    "mlp_swiglu",
    "mlp_swiglu_sequence_parallel",
    "mlp_variant",
    "row",
    "row_scatter",
    "row_sequence_parallel",
    "vocab_cross_entropy",
    "vocab_embedding",
    "vocab_embedding_padded",
    "vocab_linear_cross_entropy",
]

# Worker processes (gloo/nccl) re-resolve a variant from its target and name.
_TARGET = "tpsim.layers"


def _column(gather_output: bool):
    def build(in_features: int, out_features: int, bias: bool, *, group: Any, dtype: Any, **_: Any) -> nn.Module:
        return ColumnParallelLinear(in_features, out_features, bias, group=group, gather_output=gather_output, dtype=dtype)

    return build


def _row(input_is_parallel: bool):
    def build(in_features: int, out_features: int, bias: bool, *, group: Any, dtype: Any, **_: Any) -> nn.Module:
        return RowParallelLinear(
            in_features, out_features, bias, group=group, input_is_parallel=input_is_parallel, dtype=dtype
        )

    return build


column = Variant(
    name="ColumnParallelLinear",
    kind="column",
    build=_column(False),
    output="sharded",
    description="tpsim.layers.ColumnParallelLinear: replicated input, this rank's output slice",
    target=_TARGET,
)
column_gathered = Variant(
    name="ColumnParallelLinear(gather_output=True)",
    kind="column",
    build=_column(True),
    output="gathered",
    description="tpsim.layers.ColumnParallelLinear with gather_output=True: full output on every rank",
    target=_TARGET,
)
row = Variant(
    name="RowParallelLinear",
    kind="row",
    build=_row(True),
    input="sharded",
    output="reduced",
    description="tpsim.layers.RowParallelLinear: this rank's input slice, all-reduced output, bias added once",
    target=_TARGET,
)
row_scatter = Variant(
    name="RowParallelLinear(input_is_parallel=False)",
    kind="row",
    build=_row(False),
    input="replicated",
    output="reduced",
    description="tpsim.layers.RowParallelLinear with input_is_parallel=False: splits the full input itself",
    target=_TARGET,
)



# --- packed weights and sequence parallelism ----------------------------------------------------


def _packed_column(gather_output: bool):
    # ``parts`` comes from the variant's ``packed`` proportions, scaled to the case's out_features.
    def build(in_features: int, out_features: int, bias: bool, *, group: Any, dtype: Any, parts: Any = None,
              **_: Any) -> nn.Module:
        return ColumnParallelLinear(in_features, out_features, bias, group=group, gather_output=gather_output,
                                    parts=parts, dtype=dtype)

    return build


def _sequence_column(in_features: int, out_features: int, bias: bool, *, group: Any, dtype: Any,
                     sequence_dim: int = -2, **_: Any) -> nn.Module:
    return ColumnParallelLinear(in_features, out_features, bias, group=group, sequence_parallel=True,
                                sequence_dim=sequence_dim, dtype=dtype)


def _sequence_row(in_features: int, out_features: int, bias: bool, *, group: Any, dtype: Any,
                  sequence_dim: int = -2, **_: Any) -> nn.Module:
    return RowParallelLinear(in_features, out_features, bias, group=group, input_is_parallel=True,
                             sequence_parallel=True, sequence_dim=sequence_dim, dtype=dtype)


column_gate_up = Variant(
    name="ColumnParallelLinear(parts=gate,up)",
    kind="column",
    build=_packed_column(False),
    output="sharded",
    packed=(1, 1),
    description="tpsim.layers.ColumnParallelLinear packing gate and up (K=2): rank r holds shard r of each",
    target=_TARGET,
)
column_qkv_gqa = Variant(
    name="ColumnParallelLinear(parts=q8,k2,v2)",
    kind="column",
    build=_packed_column(False),
    output="sharded",
    packed=(8, 2, 2),
    description="tpsim.layers.ColumnParallelLinear packing Q, K, V for grouped-query attention (8:2:2 heads)",
    target=_TARGET,
)
column_qkv_gathered = Variant(
    name="ColumnParallelLinear(parts=q8,k2,v2, gather_output=True)",
    kind="column",
    build=_packed_column(True),
    output="gathered",
    packed=(8, 2, 2),
    description="packed grouped-query QKV with gather_output=True: the gathered output is back in part order",
    target=_TARGET,
)
column_sequence_parallel = Variant(
    name="ColumnParallelLinear(sequence_parallel=True)",
    kind="column",
    build=_sequence_column,
    input="sequence-sharded",
    output="sharded",
    description="tpsim.layers.ColumnParallelLinear with sequence_parallel=True: all-gathers the sequence-sharded "
    "input, reduce-scatters its grad",
    target=_TARGET,
)
row_sequence_parallel = Variant(
    name="RowParallelLinear(sequence_parallel=True)",
    kind="row",
    build=_sequence_row,
    input="sharded",
    output="sequence-sharded",
    description="tpsim.layers.RowParallelLinear with sequence_parallel=True: reduce-scatters along the sequence, "
    "bias added once per sequence shard, its grad all-reduced",
    target=_TARGET,
)

#: What ``tpsim check tpsim.layers`` checks (``column_qkv_gathered`` is left out to keep that job
#: fast; tests/test_packed.py checks it).
TPSIM_VARIANTS = [
    column,
    column_gathered,
    row,
    row_scatter,
    column_gate_up,
    column_qkv_gqa,
    column_sequence_parallel,
    row_sequence_parallel,
]

# --- whole modules: the MLPs -----------------------------------------------------------------------


def _mlp(activation: str, sequence_parallel: bool = False, initialise: bool = True):
    def build(hidden: int, ffn: int, *, group: Any, dtype: Any) -> nn.Module:
        with skip_init() if not initialise else contextlib.nullcontext():
            return ParallelMLP(hidden, ffn, activation=activation, group=group, dtype=dtype,
                               sequence_parallel=sequence_parallel)

    return build


def mlp_variant(activation: str = "swiglu", *, sequence_parallel: bool = False, initialise: bool = True) -> ModuleVariant:
    """A module variant of :class:`tpsim.layers.ParallelMLP` (sizes ``hidden``, ``ffn``).

    ``initialise=False`` builds it without drawing its parameters (the harness loads them all):
    constructing the lab note's MLP (4096 x 11008) draws the full master weights on every rank,
    seconds of work, so the lab-scale check leaves that out (and with it the comparison of
    replicated parameters right after construction)."""
    sp = ", sequence_parallel=True" if sequence_parallel else ""
    return ModuleVariant(
        name=f"ParallelMLP({activation}{sp})",
        build=_mlp(activation, sequence_parallel, initialise),
        sizes=("hidden", "ffn"),
        input="sequence-sharded" if sequence_parallel else "replicated",
        output="sequence-sharded" if sequence_parallel else "replicated",
        initialised=initialise,
        description=f"tpsim.layers.ParallelMLP(activation={activation!r}{sp}): fc1 column-parallel"
        + (" (gate and up packed, each sharded on its own)" if activation in ("swiglu", "geglu") else "")
        + ", fc2 row-parallel" + (", all-gather in and reduce-scatter out" if sequence_parallel else ""),
        target=_TARGET,
    )


mlp_gelu = mlp_variant("gelu")
mlp_swiglu = mlp_variant("swiglu")
mlp_swiglu_sequence_parallel = mlp_variant("swiglu", sequence_parallel=True)

#: The modules ``tpsim check tpsim.layers`` checks after its linear variants: each is checked against
#: itself on a one-rank tp group (tpsim.props.module), shrunk and saved like every variant.
TPSIM_MODULES = [mlp_gelu, mlp_swiglu, mlp_swiglu_sequence_parallel]


# --- vocab-parallel layers (the embedding and cross-entropy families, tpsim.props.vocab) --------------


def _embedding(padding_multiple: int):
    def build(num_embeddings: int, embedding_dim: int, *, group: Any, dtype: Any, weight: Any) -> nn.Module:
        dense = nn.Embedding(num_embeddings, embedding_dim, dtype=dtype, device="meta").to_empty(device=weight.device)
        with torch.no_grad():
            dense.weight.copy_(weight)
        # from_dense: the layer's own slicing and padding are what is checked
        return VocabParallelEmbedding.from_dense(dense, group=group, padding_multiple=padding_multiple)

    return build


vocab_embedding = EmbeddingVariant(
    name="VocabParallelEmbedding", build=_embedding(1), target=_TARGET,
    description="tpsim.layers.VocabParallelEmbedding: table rows sharded (padded to a multiple of the tp size), "
    "ids of other ranks masked, one all-reduce",
)
vocab_embedding_padded = EmbeddingVariant(
    name="VocabParallelEmbedding(padding_multiple=4)", build=_embedding(4), padding_multiple=4, target=_TARGET,
    description="tpsim.layers.VocabParallelEmbedding with Megatron's make_vocab_size_divisible_by=4",
)
vocab_cross_entropy = CrossEntropyVariant(
    name="vocab_parallel_cross_entropy", fn=vocab_parallel_cross_entropy, target=_TARGET,
    description="tpsim.layers.vocab_parallel_cross_entropy: all-reduce MAX, one all-reduce SUM, local backward",
)
vocab_linear_cross_entropy = CrossEntropyVariant(
    name="vocab_parallel_linear_cross_entropy", fn=vocab_parallel_linear_cross_entropy, input="hidden",
    target=_TARGET,
    description="tpsim.layers.vocab_parallel_linear_cross_entropy: the vocab-parallel output layer and its loss",
)

#: The vocab-parallel variants ``tpsim check tpsim.layers`` checks (embedding and cross-entropy families).
TPSIM_VOCAB = [vocab_embedding, vocab_embedding_padded, vocab_cross_entropy, vocab_linear_cross_entropy]

# --- head-sharded attention (the attention family, tpsim.props.attention) ------------------------------

attention = AttentionVariant(
    name="ParallelAttention", build=from_dense_builder(ParallelAttention), target=_TARGET,
    description="tpsim.layers.ParallelAttention: packed QKV column-parallel by heads (GQA, key/value heads "
    "replicated when fewer than ranks), attention per local head, out-projection row-parallel",
)
attention_sequence_parallel = AttentionVariant(
    name="ParallelAttention(sequence_parallel=True)", build=from_dense_builder(ParallelAttention),
    sequence_parallel=True, target=_TARGET,
    description="tpsim.layers.ParallelAttention(sequence_parallel=True): all-gather in, reduce-scatter out",
)
