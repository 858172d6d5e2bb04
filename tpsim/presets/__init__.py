"""Library presets: check a tensor-parallel library's layers, and any subclass of them, with no adapter code.

A preset is chosen by the class a target derives from (``tpsim check mypatch.py:MyRowParallelLinear``
uses the preset of the library class it subclasses) or by a module target that names the library
(``tpsim check megatron.core.tensor_parallel``). Each preset is one module of this package behind
the small :class:`Preset` interface, listed in :data:`PRESETS`; a new library is one new file and
one line here. Nothing imports a library until a target needs it.

A preset's variants belong to the family of their kind: Column/RowParallelLinear to the linear
family, a vocab-parallel embedding and cross-entropy to those of :mod:`tpsim.props.vocab`, each of
which asks :func:`library_variants` for its own kinds. A preset whose library has more classes than a
list can name (every transformers model family) says which classes it adapts by a rule instead
(``kind_of(cls)``: their kind, or None) and builds a module target's variants itself
(``target_variants(module, kinds)``).

- :mod:`tpsim.presets.megatron`: Megatron-core's Column/RowParallelLinear, VocabParallelEmbedding and
  vocab_parallel_cross_entropy (:mod:`tpsim.presets.megatron_vocab`);
- :mod:`tpsim.presets.fairscale`: fairscale's Column/RowParallelLinear;
- :mod:`tpsim.presets.transformers`: every Hugging Face transformers family with a tp plan, module by
  module (decoder layers, attentions, MLPs, MoE blocks, embeddings, heads) under its own plan, found
  generically (plan targets of the module family);
- :mod:`tpsim.presets.torchtitan`: torchtitan's Llama 3 feed-forward, attention and transformer block
  under its own tp sharding.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection
from typing import Any

from tpsim.presets._base import LibraryMissing, Preset

__all__ = ["PRESETS", "LibraryMissing", "Preset", "library_variants", "preset_for_class", "preset_for_target", "presets"]

#: The preset modules, each defining ``PRESET`` (imported lazily: they import their library only on use).
PRESETS = ("tpsim.presets.megatron", "tpsim.presets.fairscale", "tpsim.presets.deepspeed",
           "tpsim.presets.transformers", "tpsim.presets.torchtitan")


def presets() -> list[Preset]:
    """Every preset, in :data:`PRESETS` order."""
    return [importlib.import_module(name).PRESET for name in PRESETS]


def preset_for_target(module: str) -> Preset | None:
    """The preset whose library ``module`` (a bare module target) names, or None."""
    return next((p for p in presets() if module in p.targets), None)


def preset_for_class(obj: Any) -> tuple[Preset, str] | None:
    """``(preset, kind)`` when ``obj`` is, or derives from, a class a preset adapts (the nearest such
    base in its MRO decides), or is a function a preset adapts; else None. Reads paths only:
    imports nothing."""
    every = presets()
    known = {path: (p, kind) for p in every for path, kind in p.classes.items()}
    ruled = [p for p in every if callable(getattr(p, "kind_of", None))]
    for base in getattr(obj, "__mro__", None) or (obj,):
        hit = known.get(f"{getattr(base, '__module__', '')}.{getattr(base, '__qualname__', '')}")
        if hit is not None:
            return hit
        for p in ruled:
            kind = p.kind_of(base)
            if kind is not None:
                return p, kind
    return None


def library_variants(preset: Preset, kinds: Collection[str] | None = None, module: str | None = None) -> list[Any]:
    """The variants of the library's own layers (what a module target checks), of ``kinds`` only
    when given (each family asks for its own), and of the layers defined in ``module`` or below it
    only when given (``megatron.core.tensor_parallel.layers`` is not its ``cross_entropy``)."""
    own = getattr(preset, "target_variants", None)
    if callable(own) and module is not None:
        return list(own(module, kinds))
    checked = preset.load()
    return [v for path, obj in checked.items()
            if (kinds is None or preset.classes[path] in kinds) and (module is None or path.startswith(module + "."))
            for v in preset.variants(obj, preset.classes[path])]
