"""The rank side every family's rank function shares: entering the rank, its phases, the trainer.

A family's rank function (``fn(payload)``, module-level so that gloo workers and the isolated
worker can run it) starts with :func:`enter_rank` — the case, the variant (the object itself, or
resolved again from its target in a worker process), the data the parent drew, this rank's tp
group — and runs each piece of the variant's code inside :class:`rank_phase`::

    this_rank = enter_rank(payload)
    with rank_phase("build"):
        module = this_rank.variant.build(...)
    with rank_phase("forward", step):
        out = this_rank.variant.call(module, x)

:class:`rank_phase` marks the phase (an isolated worker names the phase of a rank that dies or
hangs, :func:`tpsim.mark_phase`) and turns whatever the variant raises into the
:class:`~tpsim.props.blame.VariantRaised` the parent sorts (:mod:`tpsim.props.blame`). A family that
trains (linear layers, modules) trains as people train (:func:`schedule`): each optimizer step
accumulates its micro-batches with plain ``backward()`` calls, nothing cleared in between (grad
hooks fire as in training), then :func:`trainer_step`: the trainer's sum of the grads left partial
(once per step), the target's clip, SGD (:func:`optimizer_of`: torch's own update) and
``zero_grad(set_to_none=case.set_to_none)``. Forward and backward phases are marked with the
micro-batch's index, the step phase with the optimizer step's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from tpsim.comm.rank_progress import mark_phase
from tpsim.props.blame import variant_raised
from tpsim.props.groups import tp_group
from tpsim.props.launch import variant_of
from tpsim.seeding import manual_seed

__all__ = ["LR", "MICRO_BATCHES", "OPTIMIZER_STEPS", "SGD", "ThisRank", "enter_rank", "kept_grad", "micro_batches_of",
           "optimizer_of", "rank_phase", "schedule", "total_micro_batches", "trainer_step", "zero_grad_of"]

#: Optimizer steps a training case runs; training equivalence compares the grads accumulated over the
#: first one's micro-batches and the parameters after the last one.
OPTIMIZER_STEPS = 2
#: Micro-batches the first optimizer step accumulates when a case does not say: the default of the case
#: field ``micro_batches``, and what a case file written before that field existed replays with (its
#: three draws are exactly the three steps of one micro-batch it was found with, see :func:`schedule`).
MICRO_BATCHES = 2
#: SGD learning rate of those steps.
LR = 0.1


def micro_batches_of(case: Any) -> int:
    """The micro-batches of ``case``'s first optimizer step (:data:`MICRO_BATCHES` where it has no field)."""
    return int(getattr(case, "micro_batches", MICRO_BATCHES))


def zero_grad_of(case: Any) -> bool:
    """``set_to_none`` of ``case``'s ``optimizer.zero_grad`` (True, torch's default, where it has no field)."""
    return bool(getattr(case, "set_to_none", True))


def schedule(case: Any) -> tuple[int, ...]:
    """Micro-batches per optimizer step: ``(k, 1)`` with ``k`` the case's ``micro_batches`` (at least 2
    in every case drawn). The micro-batches are drawn in this order, so ``k = 2`` draws exactly the
    three (input, upstream grad) pairs the three one-micro-batch steps of earlier versions drew."""
    return (micro_batches_of(case),) + (1,) * (OPTIMIZER_STEPS - 1)


def total_micro_batches(case: Any) -> int:
    """Micro-batches a training case runs over all its optimizer steps (inputs and upstream grads drawn)."""
    return sum(schedule(case))


class SGD:
    """Plain SGD of learning rate :data:`LR` over ``params``, as ``torch.optim.SGD(params, lr=LR)`` (no
    momentum or weight decay): :meth:`step` runs torch's own update function,
    ``torch.optim.sgd.sgd`` (the one ``torch.optim.SGD.step`` runs: ``p.add_(grad, alpha=-lr)``, a
    DTensor parameter updated in its own placement, a grad left ``Partial`` redistributed), and
    :meth:`zero_grad` does what ``Optimizer.zero_grad`` does. ``torch.optim.SGD``'s own ``step`` and
    ``zero_grad`` wrap that in profiling and hook machinery costing tens of microseconds per call and
    rank: a tenth of a small case's check, for nothing a library's code can see (the library never
    sees the harness's optimizer)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params

    def step(self) -> None:
        from torch.optim.sgd import sgd

        with torch.no_grad():
            have = [p for p in self.params if p.grad is not None]
            if have:
                sgd(have, [p.grad for p in have], [None] * len(have), foreach=False, has_sparse_grad=False,
                    weight_decay=0.0, momentum=0.0, lr=LR, dampening=0.0, nesterov=False, maximize=False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every grad (``set_to_none``), or zero it in place, detached from any graph first."""
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
                continue
            if p.grad.grad_fn is not None:
                p.grad.detach_()
            else:
                p.grad.requires_grad_(False)
            p.grad.zero_()


def optimizer_of(module: torch.nn.Module) -> SGD | None:
    """:class:`SGD` of learning rate :data:`LR` over every parameter of ``module`` (DTensor parameters
    included); None for a module without parameters. One step is ``p -= LR * p.grad``, as the dense
    reference computes it."""
    params = list(module.parameters())
    return SGD(params) if params else None


def kept_grad(p: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of ``p.grad`` (detached), as a rank records it: later micro-batches accumulate into the grad,
    the trainer's sum, a clip and ``zero_grad(set_to_none=False)`` change it in place, and a module may
    keep it in a buffer it reuses (a ``main_grad``)."""
    grad = None if p is None else p.grad
    return None if grad is None else grad.detach().clone()


@dataclass
class ThisRank:
    """What a rank function knows about itself: the ``case``, the ``variant``, the ``data`` the parent
    drew, its tp ``group`` (a process group), the group's index ``group_index``, its ``rank`` in it and the
    group's size ``tp``."""

    case: Any
    variant: Any
    data: Any
    group: Any
    group_index: int
    rank: int
    tp: int


def enter_rank(payload: dict[str, Any]) -> ThisRank:
    """This rank of the world running ``payload["case"]``: its tp group (every rank creates every
    group, in the same order) and the variant; every rank seeded alike, as training scripts do before
    they build a model (replicas must agree)."""
    case = payload["case"]
    variant = variant_of(payload)
    group, group_index, rank, tp = tp_group(case, dist.get_rank())
    manual_seed(case.seed)
    return ThisRank(case, variant, payload.get("data"), group, group_index, rank, tp)


class rank_phase:  # noqa: N801 - used as a statement: ``with rank_phase("forward", step):``
    """Run the variant's code of ``phase`` (``build``, ``forward``, ``backward``, ``step``) of SGD step
    ``step``: mark the phase, and raise what the variant raises as a
    :class:`~tpsim.props.blame.VariantRaised` (its traceback is the variant's own: this context adds no
    frame to it). Exceptions of the types in ``passthrough`` propagate unchanged (the harness's own
    findings, e.g. a parameter the loader refuses)."""

    def __init__(self, phase: str, step: int = 0, *, passthrough: tuple[type[BaseException], ...] = ()) -> None:
        self.phase, self.step, self.passthrough = phase, step, passthrough

    def __enter__(self) -> None:
        mark_phase(self.phase, None if self.phase == "build" else self.step)

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> bool:
        if err is None or not isinstance(err, Exception) or isinstance(err, self.passthrough):
            return False
        raise variant_raised(self.phase, self.step, err) from err


def trainer_step(optimizer: SGD | None, partial: Mapping[str, torch.nn.Parameter | None],
                 group: Any, step: int, summed: dict[str, torch.Tensor], *, set_to_none: bool = True,
                 clip: Callable[..., Any] | None = None, max_norm: float | None = None,
                 params: list[torch.nn.Parameter] | None = None) -> Any:
    """What the trainer does once the micro-batches of optimizer step ``step`` are accumulated: sum over
    the tp ``group`` the grads the layer leaves partial (``partial``: name -> parameter, None when the
    module has no such parameter; Megatron's ``finalize_model_grads``, once per step) — every rank joins
    the sum, with zeros where its grad is None (the checks report the missing grad) — recording step 0's
    sums in ``summed``; then the library's ``clip(params, max_norm)`` where the target supplies one (its
    code: run in the ``step`` phase); then ``optimizer.step()`` and ``optimizer.zero_grad(set_to_none)``.
    Returns what ``clip`` returned (the total norm; None without a clip). A ``clip`` with a parameter
    named ``group`` gets the tp group as ``group=``."""
    for name, p in partial.items():
        if p is None:
            continue  # the loader already refused a missing parameter
        total = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(total, group=group)
        if p.grad is not None and step == 0:
            summed[name] = total.detach().clone()
    norm = None
    if clip is not None and max_norm is not None:
        with rank_phase("step", step):
            # The tp group as ``group=`` where the clip takes it (Megatron's takes its model-parallel group;
            # a DTensor clip reads the mesh off the parameters).
            extra = {"group": group} if _takes_group(clip) else {}
            norm = clip(params if params is not None else [], max_norm, **extra)
    mark_phase("step", step)  # the harness's own code: an error in it is not the variant's
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    return norm


def _takes_group(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` has a parameter named ``group`` (it is then given the tp group)."""
    import inspect

    try:
        return "group" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
