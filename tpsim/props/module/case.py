"""A module case: one concrete example a whole module is checked on (pure data, replays exactly).

The sizes are the module's constructor sizes in the order its variant names them (``hidden``,
``ffn``); the input is ``[*batch_shape, sizes[0]]``. Everything else — parameters, inputs, upstream
grads — is drawn from ``seed`` inside the run (see :mod:`tpsim.props.module.world`), bit for bit.
In a case file it sits under ``"family": "module"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tpsim.errors import InvalidArgument
from tpsim.props.case import MAX_TENSOR_ELEMENTS, CaseBase, check_training, describe_training
from tpsim.props.layouts import needs_batch
from tpsim.props.rank import MICRO_BATCHES

__all__ = ["MODULE_INPUT_LAYOUTS", "ModuleCase"]

#: The input layouts module cases draw (``expanded`` needs values repeated along a batch dim, which
#: the module family's draws are not).
MODULE_INPUT_LAYOUTS = ("contiguous", "transposed", "strided")


@dataclass(frozen=True)
class ModuleCase(CaseBase):
    """One example for a :class:`~tpsim.module_variant.ModuleVariant`. ``tp_size`` defaults to
    ``world_size``; a smaller one splits the world into tp groups laid out by ``tp_layout`` (see
    :mod:`tpsim.props.groups`), each with its own inputs and the same parameters."""

    world_size: int
    sizes: tuple[int, ...]
    batch_shape: tuple[int, ...] = ()
    dtype: str = "float64"
    seed: int = 0
    tp_size: int | None = None
    tp_layout: str = "consecutive"
    #: The variant's names of the sizes (``hidden``, ``ffn``): reports and case files read better.
    size_names: tuple[str, ...] = ()
    #: How every rank's input and upstream grads sit in memory (:data:`MODULE_INPUT_LAYOUTS`, see
    #: :mod:`tpsim.props.layouts`): real callers pass sequence-first buffers viewed batch-first, slices.
    input_layout: str = "contiguous"
    #: The names (of ``size_names``) of sizes no rank splits: a config's counts and switches (experts,
    #: top-k, a bias switch 0/1; :attr:`tpsim.module_variant.ModuleVariant.unsharded`). They may be 0.
    unsharded: tuple[str, ...] = ()
    #: Micro-batches the first of the two optimizer steps of training equivalence accumulates, and
    #: ``optimizer.zero_grad``'s mode (:func:`tpsim.props.rank.schedule`); a case file without them
    #: (written before they existed) reads as ``micro_batches=2, set_to_none=True``.
    micro_batches: int = MICRO_BATCHES
    set_to_none: bool = True

    family: ClassVar[str] = "module"
    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("faults", "micro_batches", "set_to_none", "unsharded")
    REQUIRED: ClassVar[tuple[str, ...] | None] = ("world_size", "sizes")
    TUPLES: ClassVar[tuple[str, ...]] = ("sizes", "batch_shape", "size_names", "unsharded")

    def _check(self) -> None:
        sizes = tuple(self.sizes)
        if not sizes:
            raise InvalidArgument("sizes=() must name at least one size (the input's feature size)")
        names = tuple(self.size_names)
        if names and (len(names) != len(sizes) or not all(isinstance(n, str) for n in names)):
            raise InvalidArgument(f"size_names={list(names)!r} must name each of the {len(sizes)} sizes")
        unsharded = tuple(self.unsharded)
        if any(n not in names[1:] for n in unsharded):
            raise InvalidArgument(f"unsharded={list(unsharded)!r} must name sizes of size_names={list(names)!r} "
                                  "other than the first (the input's feature size)")
        for i, s in enumerate(sizes):
            least = 0 if names and names[i] in unsharded else 1
            if isinstance(s, bool) or not isinstance(s, int) or s < least:
                raise InvalidArgument(f"sizes entry={s!r} must be an int >= {least}")
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "size_names", names)
        object.__setattr__(self, "unsharded", unsharded)
        self._check_layout()
        check_training(self)

    def _check_layout(self) -> None:
        if self.input_layout not in MODULE_INPUT_LAYOUTS:
            raise InvalidArgument(f"input_layout={self.input_layout!r}; expected one of {', '.join(MODULE_INPUT_LAYOUTS)}")
        if needs_batch(self.input_layout) and not self.batch_shape:
            raise InvalidArgument(f"input_layout={self.input_layout!r} needs at least one batch dim; got batch_shape=[]")

    def _check_tensors(self) -> None:
        # A size product bounds every 2-D parameter: refuse absurd files before anything is allocated.
        biggest = max(self.sizes)
        if biggest * biggest > MAX_TENSOR_ELEMENTS or self.rows * biggest > MAX_TENSOR_ELEMENTS:
            raise InvalidArgument(
                f"sizes={list(self.sizes)} with batch_shape={list(self.batch_shape)} would need tensors of more than "
                f"{MAX_TENSOR_ELEMENTS} elements"
            )

    def _describe_sizes(self) -> list[str]:
        # Sizes by name when the case has them; a layout other than contiguous is said.
        layout = ([] if self.input_layout == "contiguous" else [f"input_layout={self.input_layout}"]) + describe_training(self)
        if len(self.size_names) == len(self.sizes):
            return [f"{n}={s}" for n, s in zip(self.size_names, self.sizes, strict=True)] + layout
        return [f"sizes={list(self.sizes)}"] + layout
