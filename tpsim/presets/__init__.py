"""Library presets: check a tensor-parallel library's layers, and any subclass of them, with no adapter code.

A preset is chosen by the class a target derives from (``tpsim check mypatch.py:MyRowParallelLinear``
uses the preset of the library class it subclasses) or by a module target that names the library
(``tpsim check megatron.core.tensor_parallel``). Each preset is one module of this package behind
the small :class:`Preset` interface, listed in :data:`PRESETS`; a new library is one new file and
one line here. Nothing imports a library until a target needs it.

- :mod:`tpsim.presets.megatron`: Megatron-core's Column/RowParallelLinear;
- :mod:`tpsim.presets.fairscale`: fairscale's Column/RowParallelLinear.
"""

from __future__ import annotations

import importlib

from tpsim.presets._base import LibraryMissing, Preset
from tpsim.variant import Variant

__all__ = ["PRESETS", "LibraryMissing", "Preset", "library_variants", "preset_for_class", "preset_for_target", "presets"]

#: The preset modules, each defining ``PRESET`` (imported lazily: they import their library only on use).
PRESETS = ("tpsim.presets.megatron", "tpsim.presets.fairscale")


def presets() -> list[Preset]:
    """Every preset, in :data:`PRESETS` order."""
    return [importlib.import_module(name).PRESET for name in PRESETS]


def preset_for_target(module: str) -> Preset | None:
    """The preset whose library ``module`` (a bare module target) names, or None."""
    return next((p for p in presets() if module in p.targets), None)


def preset_for_class(cls: type) -> tuple[Preset, str] | None:
    """``(preset, kind)`` when ``cls`` is, or derives from, a layer class a preset adapts (the
    nearest such base in its MRO decides), else None. Reads class paths only: imports nothing."""
    known = {path: (p, kind) for p in presets() for path, kind in p.classes.items()}
    for base in getattr(cls, "__mro__", ()):
        hit = known.get(f"{base.__module__}.{base.__qualname__}")
        if hit is not None:
            return hit
    return None


def library_variants(preset: Preset) -> list[Variant]:
    """The variants of the library's own layer classes (what a module target checks)."""
    classes = preset.load()
    return [v for path, cls in classes.items() for v in preset.variants(cls, preset.classes[path])]
