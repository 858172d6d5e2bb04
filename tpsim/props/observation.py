"""One observation of a case, for every family: the typed head of each rank's result, and the run.

Each family's rank function returns a dataclass of its own (:class:`tpsim.props.world.RankResult`
for linear layers, :class:`~tpsim.props.module.world.ModuleRankResult`, the vocab and attention
results), plain data that travels back from gloo workers and from the isolated worker. They all
start with :class:`RankOutput`: the status of the run, the rank's tp group and tp rank, and what its
forward returned. :meth:`RankOutput.unusable` is the one rule for a forward whose result cannot be
back-propagated (or compared): not a tensor, another shape than the upstream grad, cut off from
autograd, or not a real floating tensor (:func:`output_dtype_failure` names that one in every
family: ``wrong-dtype``).

:class:`Observation` is what one world run of a case produced, in every family: the case, the data
the parent drew for it, every rank's result or the run's error (and, for a family whose dense
reference is itself a run, why that reference could not be computed: :class:`DenseReferenceFailed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tpsim.diagnosis import WRONG_DTYPE, Failure, recogniser
from tpsim.errors import RankError
from tpsim.props.property_names import FORWARD

__all__ = [
    "DETACHED",
    "NOT_REAL",
    "OK",
    "OUTPUT_SHAPE",
    "DenseReferenceFailed",
    "Observation",
    "RankOutput",
    "output_dtype_failure",
]

#: :attr:`RankOutput.status` values every family uses (a family may add its own).
OK = "ok"  # built, ran every step
OUTPUT_SHAPE = "output-shape"  # the forward returned no tensor, or one of another shape than the upstream grad
DETACHED = "detached"  # the output has no autograd graph although the input requires grad
NOT_REAL = "not-real"  # the output is a complex or integer tensor, not a real floating one


@dataclass
class RankOutput:
    """The fields every family's per-rank result has.

    - ``status``: :data:`OK`, :data:`OUTPUT_SHAPE`, :data:`DETACHED`, :data:`NOT_REAL` or a family's own;
    - ``group``/``tp_rank``: this rank's tp group index and rank within it;
    - ``output``: the step-0 output (detached), None when the forward returned no tensor;
    - ``output_type``: the type name of what the forward returned.
    """

    status: str = OK
    group: int = 0
    tp_rank: int = 0
    output: torch.Tensor | None = None
    output_type: str | None = None

    def unusable(self, out: Any, shape: torch.Size, *, graph: torch.Tensor | None = None) -> bool:
        """Whether ``out`` (what the forward returned) cannot be back-propagated with an upstream grad
        of ``shape``; if so, record it (status, output, type) for the parent to report. A complex or
        integer tensor is not compared at all (casting it to the reference's dtype would drop its
        imaginary part or fraction, and an integer one has no graph): the parent names its dtype.
        With ``graph`` (an input that requires grad) an output cut off from autograd counts too:
        backward would only raise "does not require grad", where the parent can name the cause."""
        tensor = isinstance(out, torch.Tensor)
        if tensor and not out.is_floating_point():
            self.status = NOT_REAL
        elif tensor and out.shape == shape and not (
            graph is not None and graph.requires_grad and out.grad_fn is None and not out.requires_grad
        ):
            return False
        else:
            self.status = DETACHED if tensor and out.shape == shape else OUTPUT_SHAPE
        self.output = out.detach().clone() if tensor else None
        self.output_type = type(out).__name__
        return True


class DenseReferenceFailed(Exception):
    """The variant failed without any parallelism, where the dense reference is the variant itself on a
    tp group of one rank (the module family): ``error`` is what it raised, or the
    :class:`tpsim.RankDied` of that rank; ``traceback_text`` its traceback."""

    def __init__(self, error: BaseException, traceback_text: str) -> None:
        super().__init__(f"{type(error).__name__}: {error}".splitlines()[0][:500])
        self.error = error
        self.traceback_text = traceback_text


@dataclass
class Observation:
    """What one world run of a case produced, in every family.

    - ``case``: the case; ``divisible``: whether the variant can shard its sizes;
    - ``data``: what the parent drew for it from the seed (master tensors; the module family: its
      dense reference run, which drew them);
    - ``values``: every rank's result, in global rank order, or ``error``: the run's error;
    - ``reference_error``: the dense reference could not be computed (nothing else ran).
    """

    case: Any
    data: Any = None
    values: list[Any] | None = None
    error: RankError | None = None
    divisible: bool = True
    reference_error: DenseReferenceFailed | None = None

    def rank_errors(self) -> dict[int, BaseException]:
        """Every failed rank's own exception (:func:`tpsim.props.blame.rank_errors`)."""
        from tpsim.props.blame import rank_errors

        return rank_errors(self.error)


@recogniser(WRONG_DTYPE)
def output_dtype_failure(variant: Any, case: Any, values: Sequence[Any] | None) -> Failure | None:
    """``wrong-dtype`` for the first rank whose output is a complex or integer tensor
    (:data:`NOT_REAL`), in every family: it is never compared, passed or called detached."""
    for r, v in enumerate(values or ()):
        if getattr(v, "status", None) == NOT_REAL and v.output is not None:
            got = str(v.output.dtype).replace("torch.", "")
            return Failure(
                FORWARD, WRONG_DTYPE,
                f"the output on rank {r} is {got}, but the case is {case.dtype}: a layer's output must be a real "
                f"floating tensor of the input's dtype (a {'complex' if v.output.is_complex() else 'integer'} result "
                "cannot be compared with the dense one without dropping part of it, nor back-propagated as one)",
                case=case, rank=r, variant=getattr(variant, "name", None),
                details={"dtype": got, "expected_dtype": case.dtype},
            )
    return None
