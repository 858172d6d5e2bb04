"""One observation of a case, for every family: the typed head of each rank's result, and the run.

Each family's rank function returns a dataclass of its own (:class:`tpsim.props.linear.world.RankResult`
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

import sys
from dataclasses import dataclass
from typing import Any

import torch

from tpsim.comm.scheduler import text_of
from tpsim.diagnosis import WRONG_DTYPE, Failure, recogniser
from tpsim.errors import RankError
from tpsim.props.property_names import FORWARD

__all__ = [
    "DETACHED",
    "NOT_REAL",
    "OK",
    "OUTPUT_SHAPE",
    "DenseReferenceFailed",
    "NotDeterministic",
    "NotRealOutput",
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

    def read(self, out: Any) -> Any:
        """What the forward returned, as the rank reports it: a tensor as a plain ``torch.Tensor`` read
        with ``__torch_function__`` disabled (a subclass cannot make its values look right), its
        pending collective waited for, a DTensor as its ``full_tensor()`` (differentiable: its backward
        hands each rank the grad of its own piece); anything else as it is. Records its type name."""
        self.output_type = type(out).__name__
        if not isinstance(out, torch.Tensor):
            return out
        from tpsim.comm.plain import plain_tensor

        module = sys.modules.get("torch.distributed.tensor")
        if isinstance(out, getattr(module, "DTensor", ())):
            out = out.full_tensor()
        return plain_tensor(out)

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
        self.output_type = self.output_type or type(out).__name__
        return True


class NotRealOutput(Exception):
    """The variant's output is not a real floating tensor (``dtype``: its dtype), where the variant is
    its own dense reference (the module family's run on a tp group of one rank): named ``wrong-dtype``
    (:func:`output_dtype_failure`) like a rank's such output."""

    def __init__(self, dtype: str) -> None:
        super().__init__(f"the output is {dtype}, not a real floating tensor")
        self.dtype = dtype

    def __reduce__(self) -> tuple[Any, ...]:  # its field survives pickling (the isolated worker)
        return (type(self), (self.dtype,))


class NotDeterministic(Exception):
    """The variant, run twice on the same rank on the same input from the same parameters, gave
    different outputs (``max_abs``: the largest difference): dropout in train mode, unseeded noise.
    Nothing about its parallelism can be judged from such runs (named ``nondeterministic``)."""

    def __init__(self, max_abs: float) -> None:
        super().__init__(f"two runs of the forward on the same input differ by up to {max_abs:.3g}")
        self.max_abs = max_abs

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.max_abs,))


class DenseReferenceFailed(Exception):
    """The variant failed without any parallelism, where the dense reference is the variant itself on a
    tp group of one rank (the module family): ``error`` is what it raised, or the
    :class:`tpsim.RankDied` of that rank; ``traceback_text`` its traceback."""

    def __init__(self, error: BaseException, traceback_text: str) -> None:
        super().__init__(f"{type(error).__name__}: {text_of(error)}".splitlines()[0][:500])
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
def output_dtype_failure(variant: Any, obs: Observation) -> Failure | None:
    """``wrong-dtype`` for the first rank whose output is a complex or integer tensor
    (:data:`NOT_REAL`), or for such an output of the variant as its own dense reference
    (:class:`NotRealOutput`), in every family: it is never compared, passed or called detached."""
    case = obs.case
    found: tuple[int | None, torch.dtype | str, str] | None = None
    reference = None if obs.reference_error is None else obs.reference_error.error
    if isinstance(reference, NotRealOutput):
        found = (None, reference.dtype, "the output of the dense reference (the variant on a tp group of one rank)")
    for r, v in enumerate(obs.values or ()):
        if found is None and getattr(v, "status", None) == NOT_REAL and v.output is not None:
            found = (r, v.output.dtype, f"the output on rank {r}")
    if found is None:
        return None
    rank, dtype, what = found
    got = str(dtype).replace("torch.", "")
    kind = "complex" if "complex" in got else "integer"
    return Failure(
        FORWARD, WRONG_DTYPE,
        f"{what} is {got}, but the case is {case.dtype}: a layer's output must be a real floating tensor of the "
        f"input's dtype (a {kind} result cannot be compared with the dense one without dropping part of it, nor "
        "back-propagated as one)",
        case=case, rank=rank, variant=getattr(variant, "name", None), details={"dtype": got, "expected_dtype": case.dtype},
    )
