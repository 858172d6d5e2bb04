"""The ``embedding`` and ``cross-entropy`` families (:class:`tpsim.props.family.Family`).

Targets: an :class:`~tpsim.vocab_variant.EmbeddingVariant` / :class:`~tpsim.vocab_variant.CrossEntropyVariant`
(or a list of them) named ``MODULE:Name``; with ``--kind embedding`` a module class built as
``cls(num_embeddings, embedding_dim, *, group=...)`` (:func:`~tpsim.vocab_variant.embedding_from_class`);
with ``--kind cross-entropy`` a function ``fn(logits, target, ...)``
(:func:`~tpsim.vocab_variant.cross_entropy_from_function`); a bare module's ``TPSIM_VOCAB`` list,
else its module-level variants of the family's type (``tpsim.layers``: tpsim's own, declared in
:mod:`tpsim.builtin_variants`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from torch import nn

import tpsim
from tpsim.errors import InvalidArgument
from tpsim.props.checks import WEIGHT_GRAD
from tpsim.props.vocab.case import CrossEntropyCase, EmbeddingCase
from tpsim.props.vocab.checks import (
    CROSS_ENTROPY_PROPERTIES,
    EMBEDDING_PROPERTIES,
    evaluate_cross_entropy,
    evaluate_embedding,
)
from tpsim.props.vocab.strategies import cross_entropy_cases, embedding_cases
from tpsim.props.vocab.world import observe
from tpsim.vocab_variant import (
    CROSS_ENTROPY_KIND,
    EMBEDDING_KIND,
    CrossEntropyVariant,
    EmbeddingVariant,
    cross_entropy_from_function,
    embedding_from_class,
)

__all__ = ["CROSS_ENTROPY", "EMBEDDING", "CrossEntropyFamily", "EmbeddingFamily"]

#: CLI adapter flags that belong to other families: refused rather than ignored.
_FOREIGN = ("convention", "packed", "input", "output", "input_grad", "sequence_dim")
#: Packages whose globals are not made per rank (the rule of the other families).
_NOT_RANK_LOCAL = ("tpsim", "torch", "__main__", "builtins")


class _VocabFamily:
    """What both families share: resolving targets and variants, declared variants, case files."""

    name: str
    kinds: tuple[str, ...]
    variant_type: type
    properties: tuple[str, ...]
    case_type: type

    def _from_object(self, obj: Any) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def _adapt(self, variant: Any, options: Mapping[str, Any], where: str, module: ModuleType | None) -> Any:
        foreign = [k for k in _FOREIGN if options.get(k) is not None]
        if foreign:
            raise InvalidArgument(f"{where} is a {self.name} target; --{foreign[0].replace('_', '-')} applies to "
                                  "linear layers and modules")
        local = list(variant.rank_local)
        if module is not None and module.__name__.split(".")[0] not in _NOT_RANK_LOCAL:
            local.append(module.__name__)  # a user's module is per process in a real job
        if tuple(local) != variant.rank_local:
            variant = variant.replace(rank_local=tuple(dict.fromkeys(local)))
        return variant

    def resolve(self, target: str, obj: Any, options: Mapping[str, Any]) -> list[Any] | None:
        from tpsim.presets import preset_for_class
        from tpsim.target import import_target_module

        preset = None if isinstance(obj, (self.variant_type, list, tuple)) else preset_for_class(obj)
        if preset is not None and (preset[1] in self.kinds or options.get("kind") in self.kinds):
            library, kind = preset
            if kind not in self.kinds:
                raise InvalidArgument(f"{target} derives from {library.name}'s {kind} layer; --kind {options['kind']} "
                                      "contradicts it")
            # A library's layer or function, or a subclass of one (a patch): the library's preset, which
            # declares the rank-local state itself.
            return [self._adapt(v, options, target, None) for v in library.variants(obj, kind)]
        if isinstance(obj, self.variant_type):
            found = [obj]
        elif isinstance(obj, (list, tuple)) and obj and all(isinstance(v, self.variant_type) for v in obj):
            found = list(obj)
        elif options.get("kind") in self.kinds:
            found = [self._from_object(obj)]
        else:
            return None
        module = import_target_module(target.partition(":")[0])
        return [self._adapt(v, options, target, module) for v in found]

    def declared(self, target: str, module: ModuleType, options: Mapping[str, Any]) -> list[Any]:
        if options.get("kind") not in (None, *self.kinds):
            return []
        if any(options.get(k) is not None for k in _FOREIGN):
            return []  # the options adapt another family's variants of a bare module
        from tpsim.presets import library_variants, preset_for_target

        preset = preset_for_target(target)
        if preset is not None:  # a library's own layers: its preset's variants of this family's kinds
            return [self._adapt(v, options, f"{target}:{v.name}", None) for v in library_variants(preset, self.kinds, target)]
        declared = getattr(module, "TPSIM_VOCAB", None)
        if declared is not None:
            items = [v for v in declared if isinstance(v, self.variant_type)]
        else:
            items = []
            for value in vars(module).values():
                if isinstance(value, self.variant_type) and not any(value is s for s in items):
                    items.append(value)
        return [self._adapt(v, options, f"{target}:{v.name}", module) for v in items]

    def case_from_dict(self, data: Any) -> Any:
        return self.case_type.from_dict(data)

    def resolve_variant(self, target: str, name: str, options: Mapping[str, Any]) -> Any:
        from tpsim.props.family import resolve_variant

        variant = resolve_variant(target, name, options)
        if not isinstance(variant, self.variant_type):
            raise InvalidArgument(f"{target!r}: {name!r} is not a {self.name} variant")
        return variant

    def _observe(self, variant: Any, case: Any, backend: str, timeout: float, isolate: bool) -> Any:
        return observe(variant, case, backend=backend, timeout=timeout, isolate=isolate)


class EmbeddingFamily(_VocabFamily):
    """Vocab-parallel embeddings against ``nn.Embedding`` (see :mod:`tpsim.props.vocab.checks`)."""

    name = "embedding"
    kinds: tuple[str, ...] = (EMBEDDING_KIND,)
    variant_type = EmbeddingVariant
    properties = EMBEDDING_PROPERTIES
    case_type = EmbeddingCase

    def _from_object(self, obj: Any) -> EmbeddingVariant:
        if isinstance(obj, type) and issubclass(obj, nn.Module):
            return embedding_from_class(obj)
        raise InvalidArgument(f"{obj!r} is not an nn.Module class or a tpsim EmbeddingVariant (--kind embedding)")

    def plan(self, variant: EmbeddingVariant, properties: tuple[str, ...],
             dtypes: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...], list[str]]:
        kept = tuple(p for p in properties if p in self.properties)
        if not kept:
            raise InvalidArgument(f"properties={list(properties)!r}: an embedding is checked for "
                                  f"{', '.join(self.properties)}")
        return kept, dtypes, list(variant.notes)

    def cases(self, variant: EmbeddingVariant, *, world_sizes: tuple[int, ...], dtypes: tuple[str, ...],
              non_divisible: bool, tp_sizes: tuple[int, ...] | None, subgroups: bool, layouts: tuple[str, ...]) -> Any:
        # Ids are integers: memory layouts of floating inputs do not apply. A vocabulary that does not
        # divide is drawn whatever non_divisible says: a padding layer must be exact on it, a refusing
        # one is judged by the divisibility property (and passes when that is not asked for).
        return embedding_cases(variant, world_sizes=world_sizes, dtypes=dtypes, non_divisible=True,
                               tp_sizes=tp_sizes, subgroups=subgroups)

    def check_case(self, variant: EmbeddingVariant, case: EmbeddingCase, *, backend: str,
                   timeout: float = tpsim.DEFAULT_TIMEOUT, properties: Sequence[str] | None = None,
                   isolate: bool = False) -> list[Any]:
        return evaluate_embedding(variant, self._observe(variant, case, backend, timeout, isolate), properties)


class CrossEntropyFamily(_VocabFamily):
    """Vocab-parallel cross-entropies against ``F.cross_entropy`` (see :mod:`tpsim.props.vocab.checks`)."""

    name = "cross-entropy"
    kinds: tuple[str, ...] = (CROSS_ENTROPY_KIND,)
    variant_type = CrossEntropyVariant
    properties = CROSS_ENTROPY_PROPERTIES
    case_type = CrossEntropyCase

    def _from_object(self, obj: Any) -> CrossEntropyVariant:
        return cross_entropy_from_function(obj)

    def plan(self, variant: CrossEntropyVariant, properties: tuple[str, ...],
             dtypes: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...], list[str]]:
        applies = self.properties if variant.input == "hidden" else tuple(p for p in self.properties if p != WEIGHT_GRAD)
        kept = tuple(p for p in properties if p in applies)
        if not kept:
            raise InvalidArgument(f"properties={list(properties)!r}: cross-entropy {variant.name!r} is checked for "
                                  f"{', '.join(applies)}")
        notes = list(variant.notes)
        if variant.dtypes:
            kept_dtypes = tuple(d for d in dtypes if d in variant.dtypes)
            if not kept_dtypes:
                raise InvalidArgument(f"dtypes={list(dtypes)!r}: cross-entropy {variant.name!r} is checked in "
                                      f"{', '.join(variant.dtypes)} only")
            if kept_dtypes != tuple(dtypes):
                notes.append(f"{variant.name} declares dtypes {', '.join(variant.dtypes)} only")
            dtypes = kept_dtypes
        missing = [k for k in ("label_smoothing", "ignore_index", "vocab_size", "reduction", "group")
                   if k not in variant.accepts]
        consequence = {"label_smoothing": "no label smoothing", "ignore_index": "no ignored targets",
                       "vocab_size": "vocabularies divisible by the tp size only", "reduction": "per-token losses only",
                       "group": "one tp group spanning the world"}
        if missing:
            notes.append(f"{variant.name} takes no {', '.join(missing)}: "
                         + "; ".join(consequence[k] for k in missing))
        return kept, dtypes, notes

    def cases(self, variant: CrossEntropyVariant, *, world_sizes: tuple[int, ...], dtypes: tuple[str, ...],
              non_divisible: bool, tp_sizes: tuple[int, ...] | None, subgroups: bool, layouts: tuple[str, ...]) -> Any:
        # A vocabulary that does not divide is an ordinary case here, not a divisibility one: the logits
        # arrive padded with the real vocab_size, and the loss must be exact (Megatron-LM #1754). So it
        # is drawn whatever non_divisible says (which follows whether the divisibility property is asked).
        return cross_entropy_cases(variant, world_sizes=world_sizes, dtypes=dtypes, non_divisible=True,
                                   tp_sizes=tp_sizes, subgroups=subgroups)

    def check_case(self, variant: CrossEntropyVariant, case: CrossEntropyCase, *, backend: str,
                   timeout: float = tpsim.DEFAULT_TIMEOUT, properties: Sequence[str] | None = None,
                   isolate: bool = False) -> list[Any]:
        return evaluate_cross_entropy(variant, self._observe(variant, case, backend, timeout, isolate), properties)


#: The embedding family object (registered as ``"embedding"`` in :mod:`tpsim.props.family`).
EMBEDDING = EmbeddingFamily()
#: The cross-entropy family object (registered as ``"cross-entropy"`` in :mod:`tpsim.props.family`).
CROSS_ENTROPY = CrossEntropyFamily()
