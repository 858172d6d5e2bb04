"""What the library loaded, judged against the dense weights right after construction.

A module whose library loads the case's weights (:mod:`tpsim.props.module.loading`: its builder, a
loader method, a ``weight_loader``, a plan's ``distribute_tensor``, ``from_pretrained``'s cut) hands
back each rank's pieces as it holds them. Read through each parameter's layout they must assemble
into the dense weights: this is where a mis-slice is named, before any forward runs.

**The layout a piece is read through** is, in order: the DTensor's placement (``_StridedShard`` and
``Partial`` included), the declared :class:`~tpsim.variant.ParamSpec`, or the shapes
(:mod:`tpsim.props.module.sharding`). A declaration or a placement describes a layout and is held
to it: pieces that do not assemble through it are a failure, whatever else would explain them. A
layout read from the shapes alone is ambiguous where the values are not (:func:`refined`): a
replicated shape whose ranks' values add up to the dense one (a bias held by rank 0 with zeros
elsewhere, or split in ``1/tp`` terms) is ``Partial()``, and a shard that is the shard of each of
2 or 3 equal packed parts (gate/up, Q/K/V) is that packed layout — the library chose it; the forward
then says whether its code computes with it.

**A failure** (:func:`construction_failure`) counts under forward-equivalence at the sublayer that
owns the parameter, named by the shared verdict (:func:`tpsim.props.placed.verdict`): the pieces of
other ranks (``wrong-shard-order``), a contiguous slice where the layer packs its parts
(``packed-shard-layout``), every rank holding the whole of a summed parameter (``bias-duplication``),
otherwise ``mismatch`` with the facts.

**Zero copies that drift** (:func:`zero_copies_drift`): a ``Partial`` parameter held by rank 0 with
zeros elsewhere forwards correctly, but each rank's optimizer then applies the full grad to its own
copy: the zero copies move, and the sum moves ``tp`` times too far (``zero-copies-drift``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tpsim.diagnosis import ZERO_COPIES_DRIFT, Diagnosis, Failure, recogniser
from tpsim.errors import InvalidArgument
from tpsim.patterns import close
from tpsim.placement import Partial, Replicate, Shard
from tpsim.props.module.sharding import ParamLayout
from tpsim.props.placed import Placed, expected_pieces, verdict
from tpsim.props.property_names import FORWARD, TRAINING

__all__ = ["construction_failure", "refined", "zero_copies_drift"]

_F64 = torch.float64
#: Equal packed parts a shape-read shard is tried as (gate/up; Q/K/V of equal sizes).
_PACKINGS = (2, 3)


def _f64(pieces: Sequence[Any]) -> list[torch.Tensor] | None:
    if any(not isinstance(p, torch.Tensor) for p in pieces):
        return None
    return [p.detach().to(_F64) for p in pieces]


def explains(layout: ParamLayout, pieces: Sequence[torch.Tensor], full: torch.Tensor, tol: torch.Tensor) -> bool:
    """Whether ``pieces`` (float64, tp rank order) are ``full``'s under ``layout``, within ``tol``."""
    placement = layout.placement
    if isinstance(placement, Partial):
        return all(p.shape == full.shape for p in pieces) and close(sum(pieces[1:], pieces[0]), full, tol)
    try:
        want = expected_pieces(full, placement, len(pieces), layout.uneven)
        bounds = expected_pieces(tol, placement, len(pieces), layout.uneven)
    except InvalidArgument:  # packed parts that do not divide: no piece of this layout
        return False
    return all(p.shape == w.shape and close(p, w, b) for p, w, b in zip(pieces, want, bounds, strict=True))


def _candidates(layout: ParamLayout, full: torch.Tensor, tp: int) -> list[ParamLayout]:
    """What a layout read from shapes alone may also be (see the module docstring)."""
    placement = layout.placement
    if isinstance(placement, Replicate):
        return [ParamLayout(Partial())]
    if isinstance(placement, Shard) and placement.parts is None and not layout.uneven:
        size = full.shape[placement.dim]
        return [ParamLayout(Shard(placement.dim, parts=(size // k,) * k)) for k in _PACKINGS if size % (k * tp) == 0]
    return []


def refined(layouts: Mapping[str, ParamLayout], loaded: Sequence[Mapping[str, torch.Tensor]],
            masters: Mapping[str, torch.Tensor], tol: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, ParamLayout]:
    """``layouts`` with every layout read from shapes alone replaced by the one the loaded values show,
    where only that one explains them (see the module docstring). ``loaded``: each rank's loaded
    pieces; ``tol(full)``: the bound of a loaded tensor of dense value ``full``."""
    out = dict(layouts)
    for name, layout in layouts.items():
        pieces = _f64([v.get(name) for v in loaded])
        if layout.declared or pieces is None or name not in masters:
            continue
        full = masters[name].to(_F64)
        bound = tol(full)
        if explains(layout, pieces, full, bound):
            continue
        found = [c for c in _candidates(layout, full, len(pieces)) if explains(c, pieces, full, bound)]
        if len(found) == 1:
            out[name] = found[0]
    return out


def construction_failure(layouts: Mapping[str, ParamLayout], loaded: Sequence[Mapping[str, torch.Tensor]],
                         masters: Mapping[str, torch.Tensor], tol: Callable[[torch.Tensor], torch.Tensor],
                         dtype: torch.dtype, fail: Callable[..., Failure],
                         own: Mapping[str, torch.dtype] | None = None) -> Failure | None:
    """The first parameter the library loaded whose pieces are not the dense weights' under its
    layout (see the module docstring), as a forward-equivalence failure of its sublayer; None when
    every one is. ``fail(prop, diagnosis, rank, sublayer, **details)`` makes the failure; ``own``: the
    parameters the dense module keeps in a dtype of its own (judged in it, not in ``dtype``)."""
    names = [n for n in layouts if all(n in v for v in loaded) and n in masters]
    for name in names:
        layout = layouts[name]
        pieces = [v[name] for v in loaded]
        full = masters[name].to(_F64)
        summed = isinstance(layout.placement, Partial)
        how = f"read through its layout {layout.describe()}"
        placed = Placed(f"{name} right after construction (as the library loaded it, {how})", pieces, full,
                        tol(full), layout.placement, summed=summed, uneven=layout.uneven, param=name,
                        biases=((name, full),) if summed else ())
        found = verdict(placed, (own or {}).get(name, dtype))
        if found is not None:
            diag, rank = found
            return fail(FORWARD, diag, rank, name.rpartition(".")[0] or None, param=name, construction=True)
    return None


@recogniser(ZERO_COPIES_DRIFT)
def zero_copies_drift(name: str, layout: ParamLayout, initial: Sequence[torch.Tensor | None],
                      final: Sequence[torch.Tensor | None], steps: int) -> Diagnosis | None:
    """``zero-copies-drift``: a ``Partial`` parameter whose copies on ranks other than 0 were zero
    after loading and moved in training (see the module docstring)."""
    if not isinstance(layout.placement, Partial) or len(initial) < 2:
        return None
    drifted = []
    for r in range(1, len(initial)):
        start, end = initial[r], final[r]
        if start is None or end is None or bool(start.ne(0).any()):
            return None  # a copy that was not zero: a split, not a rank-0-held parameter
        moved = float(end.detach().to(_F64).abs().max()) if end.numel() else 0.0
        if moved > 0:
            drifted.append((r, moved))
    if not drifted:
        return None
    r, moved = max(drifted, key=lambda t: t[1])
    return Diagnosis(ZERO_COPIES_DRIFT,
                     f"{name} is held by tp rank 0 with zeros on the other ranks (Partial: the ranks' copies add up to "
                     f"it), but training moves the zero copies: rank {r}'s copy is {moved:.3g} away from zero after "
                     f"{steps} steps, because every rank's optimizer applies the full grad to its own copy, so the sum "
                     "moves tp times as far as the dense parameter; keep the other ranks' copies out of training "
                     "(no grad there) or hold the parameter replicated",
                     {"param": name, "rank": r, "drift": moved})


def drift_failure(ctx: Any, name: str, layout: ParamLayout, initial: Sequence[torch.Tensor | None],
                  steps: int) -> Failure | None:
    """The training failure ``zero-copies-drift`` of parameter ``name`` in ``ctx``, or None."""
    found = zero_copies_drift(name, layout, initial, [v.final.get(name) for v in ctx.values], steps)
    if found is None:
        return None
    return ctx.fail(TRAINING, found, found.details["rank"], name.rpartition(".")[0] or None, param=name)
