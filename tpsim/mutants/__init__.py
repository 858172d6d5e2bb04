"""The mutant catalog: realistic buggy tensor-parallel layers, each with the diagnosis tpsim must give.

Every mutant is a small subclass of a correct layer (:class:`CorrectColumn`, :class:`CorrectRow`,
master-weight convention: ``(in_features, out_features, bias, master_weight, *, group)``) that
changes one thing, the way real code goes wrong; its class docstring says the mechanism and the
intended diagnosis. :data:`CATALOG` lists them as :class:`Mutant` records for tests and the
benchmark::

    from tpsim.props.search import search
    from tpsim.mutants import CATALOG

    for m in CATALOG:
        report = search(m.variant, max_examples=200, seed=0)
        caught = m.diagnosis in {f.diagnosis for f in report.failures}
        print(f"{m.name}: {'caught' if caught else 'MISSED'} ({m.diagnosis})")

Each mutant's variant is also a module-level attribute, so it is a ``tpsim check`` target
(``m.target``, e.g. ``tpsim check tpsim.mutants:row_bias_before_reduce``, expected to fail) and
gloo/nccl worker processes can import it again. :data:`CORRECT` lists the correct forms, which
must pass: the master-weight column (sharded and gathered output) and row layers, and the
tp-rank-convention column and row layers (weights stored transposed).

``tpsim check tpsim.mutants`` checks the correct forms only (:data:`TPSIM_VARIANTS`, and the
correct norms of :data:`TPSIM_MODULES`); each mutant is checked by its own target. The norms are
whole modules (:class:`~tpsim.module_variant.ModuleVariant`), checked by the module family:
tpsim's own :class:`~tpsim.layers.LayerNorm` and :class:`~tpsim.layers.RMSNorm` under sequence
parallelism (:data:`CORRECT_NORMS`) and a norm that never reduces its replicated grads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from tpsim.diagnosis import (
    BIAS_DUPLICATION,
    BIAS_GRAD_RANK0_ONLY,
    BIAS_MISSING,
    COLLECTIVE_ON_STRIDED_VIEW,
    DIVISIBILITY_UNCHECKED,
    DOUBLE_REDUCTION,
    EXCEPTION,
    GRAD_MISSING,
    GRAD_NOT_REDUCED,
    GRAD_REDUCED_AFTER_ACCUMULATION,
    GRAD_SCALED,
    MISMATCH,
    MISSING_REDUCTION,
    NONDETERMINISTIC,
    NORM_COUNTS_REPLICAS,
    NORM_NOT_REDUCED,
    OUTPUT_DETACHED,
    PACKED_SHARD_LAYOUT,
    PRECISION_LOSS,
    REPLICA_DIVERGENCE,
    SHAPE_ERROR,
    WRONG_DTYPE,
    WRONG_GROUP,
    WRONG_SHARD_DIM,
    WRONG_SHARD_ORDER,
)
from tpsim.layers import LayerNorm, RMSNorm
from tpsim.module_variant import ModuleVariant
from tpsim.mutants.attention import ATTENTION_MUTANTS
from tpsim.mutants.clip import (
    clip_grad_norm,
    clip_grad_norm_counting_replicas,
    clip_grad_norm_local,
    marked_mlp,
)
from tpsim.mutants.column import (
    ColumnBackwardAverage,
    ColumnBiasDefaultDtype,
    ColumnFloorDivision,
    ColumnGatherDim1,
    ColumnGatherNoAutograd,
    ColumnGatherWrongDim,
    ColumnIgnoresBias,
    ColumnNoBackwardReduce,
    ColumnNodeLocalRank,
    ColumnReversedShards,
    ColumnWrongSplitDim,
    CorrectColumn,
)
from tpsim.mutants.gallery import (
    ColumnBackwardContiguousCopy,
    ColumnViewFlatten,
    RowContiguousCopyReduce,
    RowReplicaInitDiverges,
    RowWrongGroup,
)
from tpsim.mutants.packed import (
    CorrectPackedGateUp,
    CorrectPackedQKV,
    PackedDivisibilityOnTotal,
    PackedGateUpContiguous,
    PackedQKVContiguous,
)
from tpsim.mutants.row import (
    CorrectRow,
    RowBiasBeforeReduce,
    RowBiasDivided,
    RowBiasRank0Only,
    RowFlattenNoRestore,
    RowHalfPrecisionReduce,
    RowNoReduceWithoutBias,
    RowReduceFloat32,
    RowReduceStridedView,
    RowReduceTwice,
    RowWeightData,
)
from tpsim.mutants.sequence import (
    CorrectSequenceRow,
    SequenceNormNoGradReduce,
    SequenceRowBiasGradHookReduce,
    SequenceRowBiasGradNotReduced,
    SequenceRowScatterBatchDim,
)
from tpsim.mutants.sizes import ColumnTileReusesFirst, RowChunkDropsRemainder, RowLargeKReduceTwice
from tpsim.mutants.tp_rank import CorrectTpRankColumn, CorrectTpRankRow
from tpsim.mutants.vocab import VOCAB_MUTANTS
from tpsim.placement import Replicate, Shard
from tpsim.variant import ParamSpec, Variant

__all__ = [
    "CATALOG",
    "CORRECT",
    "CORRECT_NORMS",
    "CORRECT_PACKED_AND_SEQUENCE",
    "TPSIM_MODULES",
    "TPSIM_VARIANTS",
    "Mutant",
    "master_weight_variant",
    "norm_variant",
    "tp_rank_variant",
]

_MODULE = "tpsim.mutants"


def _first_paragraph(text: str | None) -> str:
    return " ".join((text or "").strip().split("\n\n")[0].split())


def master_weight_variant(cls: type[nn.Module], kind: str, *, name: str, output: str | None = None) -> Variant:
    """A variant for a master-weight class that also takes ``group=``.

    The class slices the master weight itself (``load=False``: its slicing is under test); the
    harness loads the bias by its placement (column ``S(0)``, row ``R``) over the zero init.
    """

    def build(in_features: int, out_features: int, bias: bool, *, group: Any, master_weight: Any, **_: Any) -> nn.Module:
        return cls(in_features, out_features, bias, master_weight.clone(), group=group)

    shard = Shard(0) if kind == "column" else Shard(1)
    params = (
        ParamSpec("weight", "weight", shard, load=False),
        ParamSpec("bias", "bias", Shard(0) if kind == "column" else Replicate()),
    )
    return Variant(
        name=name,
        kind=kind,
        build=build,
        output=output,
        params=params,
        description=_first_paragraph(cls.__doc__),
        target=f"{_MODULE}:{name}",
    )


def tp_rank_variant(cls: type[nn.Module], kind: str, *, name: str) -> Variant:
    """A variant for a tp-rank-convention class: own init, weight stored transposed, harness loads all."""

    def build(in_features: int, out_features: int, bias: bool, *, group: Any, rank: int, world_size: int,
              dtype: Any, **_: Any) -> nn.Module:
        return cls(in_features, out_features, world_size, rank, tp_group=group, bias=bias).to(dtype)

    shard = Shard(0) if kind == "column" else Shard(1)
    params = (
        ParamSpec("weight", "weight", shard, transposed=True),
        ParamSpec("bias", "bias", Shard(0) if kind == "column" else Replicate()),
    )
    return Variant(
        name=name,
        kind=kind,
        build=build,
        params=params,
        description=_first_paragraph(cls.__doc__),
        target=f"{_MODULE}:{name}",
    )


def norm_variant(cls: type[nn.Module], *, name: str, **options: Any) -> ModuleVariant:
    """A module variant for a norm class built as ``cls(hidden, *, group, dtype, **options)``, run on
    sequence-sharded activations (sequence parallelism: each rank normalises its own tokens), its
    replicated parameters read from their shapes."""

    def build(hidden: int, *, group: Any, dtype: Any) -> nn.Module:
        return cls(hidden, group=group, dtype=dtype, **options)

    return ModuleVariant(name=name, build=build, sizes=("hidden",), input="sequence-sharded",
                         output="sequence-sharded", description=_first_paragraph(cls.__doc__),
                         target=f"{_MODULE}:{name}")


class DropoutInTrainMode(nn.Module):
    """tpsim's parallel GELU MLP followed by dropout left in train mode: every run (and every rank)
    draws another mask, so no run equals the dense one; the harness must say the forward is not
    deterministic, not blame a reduction (dropout's 1/(1-p) scaling looks like a scaled output)."""

    def __init__(self, hidden: int, ffn: int, *, group: Any = None, dtype: Any = None) -> None:
        super().__init__()
        from tpsim.layers import ParallelMLP

        self.mlp = ParallelMLP(hidden, ffn, activation="gelu", group=group, dtype=dtype)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: Any) -> Any:
        return self.dropout(self.mlp(x))


def _clipped_mlp(name: str, clip: Any) -> ModuleVariant:
    """tpsim's GELU MLP, its sharded parameters marked as Megatron marks them, trained with ``clip``."""
    return ModuleVariant(name=name, build=marked_mlp, sizes=("hidden", "ffn"), clip=clip,
                         description=_first_paragraph(clip.__doc__), target=f"{_MODULE}:{name}")


def _module_dropout_in_train_mode() -> ModuleVariant:
    def build(hidden: int, ffn: int, *, group: Any, dtype: Any) -> nn.Module:
        return DropoutInTrainMode(hidden, ffn, group=group, dtype=dtype).train()

    return ModuleVariant(name="module_dropout_in_train_mode", build=build, sizes=("hidden", "ffn"),
                         description=_first_paragraph(DropoutInTrainMode.__doc__),
                         target=f"{_MODULE}:module_dropout_in_train_mode")


@dataclass(frozen=True)
class Mutant:
    """One catalogued bug.

    ``name``: stable id (``column-wrong-split-dim``); ``target``: the ``tpsim check`` target of its
    variant; ``variant``: the variant, of any family (a :class:`~tpsim.variant.Variant`, a
    :class:`~tpsim.module_variant.ModuleVariant`, ...); ``diagnosis``: the diagnosis tpsim
    must report (a name registered in :data:`tpsim.diagnosis.REGISTRY`); ``description``: the mechanism
    (the class docstring's first paragraph); ``needs``: what a case must have for the bug to show
    (empty: most cases), for readers of the catch table.
    """

    name: str
    target: str
    variant: Any
    diagnosis: str
    description: str
    needs: str = ""


def _mutant(name: str, cls: type[nn.Module], kind: str, diagnosis: str, *, output: str | None = None,
            needs: str = "", **changes: Any) -> tuple[Mutant, Variant]:
    attr = name.replace("-", "_")
    variant = master_weight_variant(cls, kind, name=attr, output=output)
    if changes:  # e.g. packed=(1, 1): the variant's declared layout
        variant = variant.replace(**changes)
    return Mutant(name, variant.target or "", variant, diagnosis, _first_paragraph(cls.__doc__), needs), variant


# --- correct forms (must pass) ---------------------------------------------------------------------

correct_column = master_weight_variant(CorrectColumn, "column", name="correct_column")


class _CorrectColumnGathered(CorrectColumn):
    """The correct master-weight column layer with its output gathered on every rank."""

    gather = True


correct_column_gathered = master_weight_variant(
    _CorrectColumnGathered, "column", name="correct_column_gathered", output="gathered"
)
correct_row = master_weight_variant(CorrectRow, "row", name="correct_row")
correct_packed_gate_up = master_weight_variant(CorrectPackedGateUp, "column", name="correct_packed_gate_up").replace(
    packed=(1, 1))
correct_packed_qkv = master_weight_variant(CorrectPackedQKV, "column", name="correct_packed_qkv").replace(
    packed=(8, 2, 2))
correct_sequence_row = master_weight_variant(CorrectSequenceRow, "row", name="correct_sequence_row",
                                             output="sequence-sharded")
#: Correct packed and sequence-parallel forms: they must pass too (tests/test_packed.py,
#: tests/test_sequence_parallel.py check them; kept out of CORRECT to keep that list's 500-example
#: runs as they were).
CORRECT_PACKED_AND_SEQUENCE: list[Variant] = [correct_packed_gate_up, correct_packed_qkv, correct_sequence_row]
correct_tp_rank_column = tp_rank_variant(CorrectTpRankColumn, "column", name="correct_tp_rank_column")
correct_tp_rank_row = tp_rank_variant(CorrectTpRankRow, "row", name="correct_tp_rank_row")

#: The correct forms: every one must pass the whole suite.
CORRECT: list[Variant] = [
    correct_column,
    correct_column_gathered,
    correct_row,
    correct_tp_rank_column,
    correct_tp_rank_row,
]
#: What ``tpsim check tpsim.mutants`` checks: the correct forms.
TPSIM_VARIANTS = CORRECT
correct_sequence_layer_norm = norm_variant(LayerNorm, name="correct_sequence_layer_norm")
correct_sequence_rms_norm = norm_variant(RMSNorm, name="correct_sequence_rms_norm")
#: tpsim's own norms under sequence parallelism, checked by the module family: they must pass.
CORRECT_NORMS: list[ModuleVariant] = [correct_sequence_layer_norm, correct_sequence_rms_norm]
#: The whole modules ``tpsim check tpsim.mutants`` checks: the correct norms.
TPSIM_MODULES = CORRECT_NORMS
#: tpsim's MLP trained with a distributed clip by global norm that counts each parameter once: it must pass.
correct_module_clip = _clipped_mlp("correct_module_clip", clip_grad_norm)
module_clip_counts_replicas = _clipped_mlp("module_clip_counts_replicas", clip_grad_norm_counting_replicas)
module_clip_local_norm = _clipped_mlp("module_clip_local_norm", clip_grad_norm_local)

# --- the catalog ---------------------------------------------------------------------------------

_ENTRIES = [
    # The skill's row layer: full bias on every rank, then the caller's all-reduce.
    _mutant("row-bias-before-reduce", RowBiasBeforeReduce, "row", BIAS_DUPLICATION, output="partial",
            needs="bias, world size >= 2"),
    _mutant("row-bias-rank0-only", RowBiasRank0Only, "row", BIAS_GRAD_RANK0_ONLY, needs="bias, world size >= 2"),
    _mutant("row-bias-divided", RowBiasDivided, "row", GRAD_SCALED, needs="bias, world size >= 2"),
    _mutant("column-wrong-split-dim", ColumnWrongSplitDim, "column", WRONG_SHARD_DIM, needs="world size >= 2"),
    _mutant("column-reversed-shards", ColumnReversedShards, "column", WRONG_SHARD_ORDER, needs="world size >= 2"),
    _mutant("column-no-backward-reduce", ColumnNoBackwardReduce, "column", GRAD_NOT_REDUCED,
            needs="world size >= 2"),
    _mutant("column-backward-average", ColumnBackwardAverage, "column", GRAD_SCALED, needs="world size >= 2"),
    _mutant("column-floor-division", ColumnFloorDivision, "column", DIVISIBILITY_UNCHECKED,
            needs="out_features not divisible by the world size"),
    _mutant("column-gather-wrong-dim", ColumnGatherWrongDim, "column", WRONG_SHARD_DIM, output="gathered",
            needs="batched input, world size >= 2"),
    _mutant("column-node-local-rank", ColumnNodeLocalRank, "column", WRONG_SHARD_ORDER,
            needs="world size > 4"),
    _mutant("column-gather-dim1", ColumnGatherDim1, "column", WRONG_SHARD_DIM, output="gathered",
            needs="3-D (or deeper) input, world size >= 2"),
    _mutant("row-no-reduce-without-bias", RowNoReduceWithoutBias, "row", MISSING_REDUCTION,
            needs="bias=False, world size >= 2"),
    _mutant("row-half-precision-reduce", RowHalfPrecisionReduce, "row", PRECISION_LOSS,
            needs="float32 or float64, world size >= 2"),
    _mutant("column-ignores-bias", ColumnIgnoresBias, "column", BIAS_MISSING, needs="bias"),
    _mutant("row-flatten-no-restore", RowFlattenNoRestore, "row", SHAPE_ERROR,
            needs="input that is not 2-D"),
    _mutant("column-bias-default-dtype", ColumnBiasDefaultDtype, "column", EXCEPTION,
            needs="bias, a dtype other than float32"),
    # Diagnoses that identify rather than guess: each name on its own evidence.
    _mutant("row-reduce-twice", RowReduceTwice, "row", DOUBLE_REDUCTION, needs="world size >= 2"),
    _mutant("row-weight-data", RowWeightData, "row", GRAD_MISSING),
    _mutant("row-reduce-float32", RowReduceFloat32, "row", WRONG_DTYPE, needs="a dtype other than float32"),
    _mutant("row-reduce-strided-view", RowReduceStridedView, "row", COLLECTIVE_ON_STRIDED_VIEW),
    _mutant("column-gather-no-autograd", ColumnGatherNoAutograd, "column", OUTPUT_DETACHED, output="gathered"),
    # Packed weights and sequence parallelism; each docstring cites its report.
    _mutant("packed-gate-up-contiguous", PackedGateUpContiguous, "column", PACKED_SHARD_LAYOUT,
            needs="world size >= 2", packed=(1, 1)),
    _mutant("packed-qkv-gqa-contiguous", PackedQKVContiguous, "column", PACKED_SHARD_LAYOUT,
            needs="world size >= 2", packed=(8, 2, 2)),
    _mutant("packed-divisibility-on-total", PackedDivisibilityOnTotal, "column", DIVISIBILITY_UNCHECKED,
            needs="a packed part not divisible by the world size while their sum is", packed=(1, 1)),
    _mutant("sequence-scatter-batch-dim", SequenceRowScatterBatchDim, "row", WRONG_SHARD_DIM,
            output="sequence-sharded", needs="3-D (or deeper) input, world size >= 2"),
    _mutant("sequence-bias-grad-not-reduced", SequenceRowBiasGradNotReduced, "row", GRAD_NOT_REDUCED,
            output="sequence-sharded", needs="bias, world size >= 2, a sequence longer than one token per rank"),
    _mutant("sequence-bias-grad-hook-reduce", SequenceRowBiasGradHookReduce, "row", GRAD_REDUCED_AFTER_ACCUMULATION,
            output="sequence-sharded", needs="bias, world size >= 2, 2 or more micro-batches accumulated"),
    # A whole module, checked by the module family: a sequence-parallel norm.
    (lambda v: (Mutant("sequence-norm-no-grad-reduce", v.target or "", v, GRAD_NOT_REDUCED, v.description,
                       "world size >= 2"), v))(
        norm_variant(SequenceNormNoGradReduce, name="sequence_norm_no_grad_reduce")),
    (lambda v: (Mutant("module-dropout-in-train-mode", v.target or "", v, NONDETERMINISTIC, v.description), v))(
        _module_dropout_in_train_mode()),
    (lambda v: (Mutant("module-clip-counts-replicas", v.target or "", v, NORM_COUNTS_REPLICAS, v.description,
                       "tp size >= 2"), v))(module_clip_counts_replicas),
    (lambda v: (Mutant("module-clip-local-norm", v.target or "", v, NORM_NOT_REDUCED, v.description,
                       "tp size >= 2"), v))(module_clip_local_norm),
    # The gallery of published bugs (tpsim/mutants/gallery.py); each docstring cites its report.
    _mutant("row-wrong-group", RowWrongGroup, "row", WRONG_GROUP, needs="tp_size < world_size"),
    _mutant("row-contiguous-copy-reduce", RowContiguousCopyReduce, "row", MISSING_REDUCTION,
            needs="transposed (sequence-first) or strided input, world size >= 2"),
    _mutant("column-backward-contiguous-copy", ColumnBackwardContiguousCopy, "column", GRAD_NOT_REDUCED,
            needs="transposed or strided upstream gradient, world size >= 2"),
    _mutant("column-view-flatten", ColumnViewFlatten, "column", EXCEPTION,
            needs="non-contiguous input with 2 or more batch dims"),
    (lambda v: (Mutant("row-replica-init-diverges", v.target or "", v, REPLICA_DIVERGENCE,
                       _first_paragraph(RowReplicaInitDiverges.__doc__), "bias, tp size >= 2"), v))(
        tp_rank_variant(RowReplicaInitDiverges, "row", name="row_replica_init_diverges")),
    # Correct only at small sizes (tpsim/mutants/sizes.py): a tile, a chunk and a large-K code path.
    _mutant("column-tile-reuses-first", ColumnTileReusesFirst, "column", MISMATCH,
            needs="more than 4 output features per rank"),
    _mutant("row-chunk-drops-remainder", RowChunkDropsRemainder, "row", MISMATCH,
            needs="more than 8 input features per rank, not a multiple of 8"),
    _mutant("row-large-k-reduce-twice", RowLargeKReduceTwice, "row", DOUBLE_REDUCTION,
            needs="16 or more input features per rank, world size >= 2"),
    # Vocab-parallel embeddings and cross-entropies (tpsim/mutants/vocab.py); each docstring cites its report.
    *((Mutant(name, v.target or "", v, diagnosis, v.description, needs), v) for name, v, diagnosis, needs in VOCAB_MUTANTS),
    # Head-sharded attention (tpsim/mutants/attention.py); each docstring cites its report.
    *((Mutant(name, v.target or "", v, diagnosis, v.description, needs), v)
      for name, v, diagnosis, needs in ATTENTION_MUTANTS),
]

#: Every catalogued mutant, in a stable order.
CATALOG: list[Mutant] = [m for m, _ in _ENTRIES]

# Module-level attributes so that each mutant's target (``tpsim.mutants:<name>``) resolves.
for _m, _v in _ENTRIES:
    globals()[_v.name] = _v
del _m, _v
