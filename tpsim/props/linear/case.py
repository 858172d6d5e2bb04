"""A linear case: one concrete example a single linear layer is checked on (pure data, replays exactly).

The master weight ``[out_features, in_features]``, its bias and every tp group's inputs and upstream
grads are drawn from ``seed`` (:mod:`tpsim.props.linear.world`). Linear cases were the first family's:
their case files carry no ``family`` field (:mod:`tpsim.props.case`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from tpsim.errors import InvalidArgument
from tpsim.props.case import (
    INPUT_LAYOUTS,
    MAX_TENSOR_ELEMENTS,
    CaseBase,
    check_training,
    choice,
    describe_training,
)
from tpsim.props.rank import MICRO_BATCHES

__all__ = ["Case"]


@dataclass(frozen=True)
class Case(CaseBase):
    """One example of a linear layer. ``tp_size`` defaults to ``world_size`` (one tp group spanning
    the world); a smaller ``tp_size`` splits the world into ``world_size // tp_size`` tp groups laid
    out by ``tp_layout`` (``consecutive`` or ``strided``, see :mod:`tpsim.props.groups`);
    ``input_layout`` is the memory layout of the inputs and upstream grads (see
    :mod:`tpsim.props.layouts`). ``micro_batches``: the micro-batches the first of the two optimizer
    steps of training equivalence accumulates (:func:`tpsim.props.rank.schedule`); ``set_to_none``: the
    mode of ``optimizer.zero_grad`` after each step (grads dropped, or zeroed in place). A case file
    without them (written before they existed) reads as ``micro_batches=2, set_to_none=True``."""

    world_size: int
    in_features: int
    out_features: int
    batch_shape: tuple[int, ...] = ()
    dtype: str = "float64"
    bias: bool = False
    seed: int = 0
    tp_size: int | None = None
    input_layout: str = "contiguous"
    tp_layout: str = "consecutive"
    micro_batches: int = MICRO_BATCHES
    set_to_none: bool = True

    SIZES: ClassVar[tuple[str, ...]] = ("in_features", "out_features")
    FLAGS: ClassVar[tuple[str, ...]] = ("bias",)
    #: Linear case files always carried their (possibly empty) fault plan; the training fields came
    #: later (at their defaults a case keeps its file's contents and name).
    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("micro_batches", "set_to_none")

    def _check(self) -> None:
        check_training(self)
        if not isinstance(self.bias, bool):
            raise InvalidArgument(f"bias={self.bias!r} must be a bool")
        choice(self.input_layout, "input_layout", INPUT_LAYOUTS)
        if self.input_layout in ("transposed", "expanded") and not self.batch_shape:
            raise InvalidArgument(
                f"input_layout={self.input_layout!r} needs at least one batch dim; got batch_shape={list(self.batch_shape)}"
            )

    def _check_tensors(self) -> None:
        shape = self.batch_shape
        for what, dims in (("the master weight [out_features, in_features]", (self.out_features, self.in_features)),
                           ("the input [*batch_shape, in_features]", (*shape, self.in_features)),
                           ("the output [*batch_shape, out_features]", (*shape, self.out_features))):
            if math.prod(dims) > MAX_TENSOR_ELEMENTS:
                raise InvalidArgument(
                    f"{what} would have {math.prod(dims)} elements (shape {list(dims)}); a case may have at most "
                    f"{MAX_TENSOR_ELEMENTS} per tensor"
                )

    def _describe_more(self) -> list[str]:
        if self.input_layout == "contiguous":
            return describe_training(self)
        from tpsim.props.layouts import layout_info

        info = layout_info((*self.batch_shape, self.in_features), self.input_layout)
        return [f"input_layout={self.input_layout} (input shape {info['shape']} strides {info['strides']})",
                *describe_training(self)]


