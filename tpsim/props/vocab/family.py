"""The ``embedding`` and ``cross-entropy`` families (:class:`tpsim.props.family.Family`).

Targets: an :class:`~tpsim.vocab_variant.EmbeddingVariant` / :class:`~tpsim.vocab_variant.CrossEntropyVariant`
(or a list of them) named ``MODULE:Name``; with ``--kind embedding`` a module class built as
``cls(num_embeddings, embedding_dim, *, group=...)`` (:func:`~tpsim.vocab_variant.embedding_from_class`);
with ``--kind cross-entropy`` a function ``fn(logits, target, ...)``
(:func:`~tpsim.vocab_variant.cross_entropy_from_function`); a library's layer or function, or a
subclass of one (its preset); a bare module's ``TPSIM_VOCAB`` list, else its module-level variants
of the family's type (``tpsim.layers``: tpsim's own, declared in :mod:`tpsim.builtin_variants`).

One world run per case (:mod:`tpsim.props.vocab.world`: the data drawn in the parent, the rank
functions), judged against ``nn.Embedding`` / ``F.cross_entropy`` in float64 by
:mod:`tpsim.props.vocab.checks`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from tpsim.diagnosis import (
    GRAD_NOT_REDUCED,
    LABEL_SMOOTHING_PER_SHARD,
    LOSS_OFF_BY_LOG_TP,
    MAX_NOT_REDUCED,
    VOCAB_MASK_MISSING,
    VOCAB_PADDING_IN_SOFTMAX,
)
from tpsim.errors import InvalidArgument
from tpsim.props.family import Family, World
from tpsim.props.observation import Observation
from tpsim.props.property_names import WEIGHT_GRAD
from tpsim.props.vocab.case import CrossEntropyCase, EmbeddingCase
from tpsim.props.vocab.checks import (
    CROSS_ENTROPY_CHECKS,
    CROSS_ENTROPY_PROPERTIES,
    EMBEDDING_CHECKS,
    EMBEDDING_PROPERTIES,
    CrossEntropyContext,
    EmbeddingContext,
    cross_entropy_failed,
)
from tpsim.props.vocab.strategies import cross_entropy_cases, embedding_cases
from tpsim.props.vocab.world import cross_entropy_data, cross_entropy_rank, embedding_data, embedding_rank
from tpsim.vocab_variant import (
    CROSS_ENTROPY_KIND,
    EMBEDDING_KIND,
    CrossEntropyVariant,
    EmbeddingVariant,
    cross_entropy_from_function,
    embedding_from_class,
)

__all__ = ["CROSS_ENTROPY", "EMBEDDING", "CrossEntropyFamily", "EmbeddingFamily"]


class _VocabFamily(Family):
    """What both families share: targets from a library's preset or from ``--kind``."""

    declared_list = "TPSIM_VOCAB"
    declared_list_shared = True  # both families' variants, in one list
    # A vocabulary that does not divide is an ordinary case, drawn whatever the divisibility property
    # says: an embedding that pads must be exact on it (one that refuses is judged by that property, and
    # passes when it is not asked for); a cross-entropy's logits arrive padded with the real vocab_size,
    # and the loss must be exact (Megatron-LM #1754).
    uneven_sizes_are_cases = True

    def _from_kind(self, obj: Any) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def from_object(self, target: str, obj: Any, options: Mapping[str, Any]) -> list[Any] | None:
        from tpsim.presets import preset_for_class

        preset = None if isinstance(obj, (list, tuple)) else preset_for_class(obj)
        if preset is not None and (preset[1] in self.kinds or options.get("kind") in self.kinds):
            library, kind = preset
            if kind not in self.kinds:
                raise InvalidArgument(f"{target} derives from {library.name}'s {kind} layer; --kind {options['kind']} "
                                      "contradicts it")
            # A library's layer or function, or a subclass of one (a patch): the library's preset, which
            # declares the rank-local state itself.
            return [self.adapt(v, options, target) for v in library.variants(obj, kind)]
        if options.get("kind") not in self.kinds:
            return None
        from tpsim._target_files import import_target_module

        module = import_target_module(target.partition(":")[0])
        return [self.own_module(self.adapt(self._from_kind(obj), options, target), module)]


class EmbeddingFamily(_VocabFamily, name="embedding", kinds=(EMBEDDING_KIND,), variant_type=EmbeddingVariant,
                      case_type=EmbeddingCase, properties=EMBEDDING_PROPERTIES, subject="an embedding"):
    """Vocab-parallel embeddings against ``nn.Embedding`` (see :mod:`tpsim.props.vocab.checks`)."""

    strategy = staticmethod(embedding_cases)  # ids are integers: memory layouts of floating inputs do not apply
    checks = EMBEDDING_CHECKS
    context_type = EmbeddingContext

    def _from_kind(self, obj: Any) -> EmbeddingVariant:
        if isinstance(obj, type) and issubclass(obj, nn.Module):
            return embedding_from_class(obj)
        raise InvalidArgument(f"{obj!r} is not an nn.Module class or a tpsim EmbeddingVariant (--kind embedding)")

    def fault_case(self, variant: EmbeddingVariant, world_size: int, seed: int) -> EmbeddingCase:
        sd = variant.sequence_dim
        batch = [4] * max(1, variant.min_batch_dims, 0 if sd is None else sd + 1)
        if sd is not None:  # the dim the layer scatters its output along: a multiple of the tp size
            batch[sd] = 2 * world_size
        return EmbeddingCase(world_size, 2 * world_size, 2, tuple(batch), seed=seed)

    def divisible(self, variant: EmbeddingVariant, case: EmbeddingCase) -> bool:
        return case.vocab_size % (case.tp_size or case.world_size) == 0

    def world(self, variant: EmbeddingVariant, case: EmbeddingCase, **_: Any) -> World:
        data = embedding_data(case, variant.padding_multiple)
        return World(embedding_rank, {"case": case, "data": data}, data)

    def offending(self, variant: EmbeddingVariant, case: EmbeddingCase) -> tuple[str, list[int]]:
        tp = case.tp_size or case.world_size
        return f"vocab_size={case.vocab_size} is not divisible by tp_size={tp}", [case.vocab_size, tp]

    def failed_run(self, variant: EmbeddingVariant, obs: Observation) -> Any:
        from tpsim.props.blame import run_failure

        return run_failure(variant.name, obs.case, obs.error, backward=WEIGHT_GRAD)  # type: ignore[arg-type]


class CrossEntropyFamily(_VocabFamily, name="cross-entropy", kinds=(CROSS_ENTROPY_KIND,),
                         variant_type=CrossEntropyVariant, case_type=CrossEntropyCase,
                         properties=CROSS_ENTROPY_PROPERTIES, subject="a cross-entropy"):
    """Vocab-parallel cross-entropies against ``F.cross_entropy`` (see :mod:`tpsim.props.vocab.checks`)."""

    strategy = staticmethod(cross_entropy_cases)
    checks = CROSS_ENTROPY_CHECKS
    context_type = CrossEntropyContext

    # Losses read from numeric patterns (an offset of log tp, a per-shard smoothing term): on a
    # bfloat16/float16/float32 case, named only as the same case in float64 shows them.
    confirmed_in_float64 = frozenset({LOSS_OFF_BY_LOG_TP, LABEL_SMOOTHING_PER_SHARD, MAX_NOT_REDUCED,
                                      VOCAB_PADDING_IN_SOFTMAX, VOCAB_MASK_MISSING, GRAD_NOT_REDUCED})

    def _from_kind(self, obj: Any) -> CrossEntropyVariant:
        return cross_entropy_from_function(obj)

    def applicable(self, variant: CrossEntropyVariant) -> tuple[str, ...]:
        # Logits have no weights: a classifier's grads are checked for hidden-state variants only.
        return self.properties if variant.input == "hidden" else tuple(p for p in self.properties if p != WEIGHT_GRAD)

    def nothing_applies(self, variant: CrossEntropyVariant, properties: tuple[str, ...], applies: tuple[str, ...]) -> str:
        return f"properties={list(properties)!r}: cross-entropy {variant.name!r} is checked for {', '.join(applies)}"

    def plan_dtypes(self, variant: CrossEntropyVariant, dtypes: tuple[str, ...]) -> tuple[tuple[str, ...], list[str]]:
        if not variant.dtypes:
            return dtypes, []
        kept = tuple(d for d in dtypes if d in variant.dtypes)
        if not kept:
            raise InvalidArgument(f"dtypes={list(dtypes)!r}: cross-entropy {variant.name!r} is checked in "
                                  f"{', '.join(variant.dtypes)} only")
        return kept, [] if kept == dtypes else [f"{variant.name} declares dtypes {', '.join(variant.dtypes)} only"]

    def notes(self, variant: CrossEntropyVariant) -> list[str]:
        missing = [k for k in ("label_smoothing", "ignore_index", "vocab_size", "reduction", "group")
                   if k not in variant.accepts]
        consequence = {"label_smoothing": "no label smoothing", "ignore_index": "no ignored targets",
                       "vocab_size": "vocabularies divisible by the tp size only", "reduction": "per-token losses only",
                       "group": "one tp group spanning the world"}
        if not missing:
            return []
        return [f"{variant.name} takes no {', '.join(missing)}: " + "; ".join(consequence[k] for k in missing)]

    def fault_case(self, variant: CrossEntropyVariant, world_size: int, seed: int) -> CrossEntropyCase:
        dtype = variant.dtypes[0] if variant.dtypes else "float64"
        return CrossEntropyCase(world_size, 2 * world_size, (4,), dtype, seed, hidden=2 if variant.input == "hidden" else 0)

    def world(self, variant: CrossEntropyVariant, case: CrossEntropyCase, **_: Any) -> World:
        data = cross_entropy_data(case, "ignore_index" in variant.accepts)
        return World(cross_entropy_rank, {"case": case, "data": data}, data)

    def failed_run(self, variant: CrossEntropyVariant, obs: Observation) -> Any:
        return cross_entropy_failed(variant, obs)


#: The embedding family object (registered as ``"embedding"`` in :mod:`tpsim.props.family`).
EMBEDDING = EmbeddingFamily()
#: The cross-entropy family object (registered as ``"cross-entropy"`` in :mod:`tpsim.props.family`).
CROSS_ENTROPY = CrossEntropyFamily()
