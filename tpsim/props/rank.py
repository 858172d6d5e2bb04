"""The rank side every family's rank function shares: entering the rank, its phases, the trainer.

A family's rank function (``fn(payload)``, module-level so that gloo workers and the isolated
worker can run it) starts with :func:`enter_rank` — the case, the variant (the object itself, or
resolved again from its target in a worker process), the data the parent drew, this rank's tp
group — and runs each piece of the variant's code inside :class:`rank_phase`::

    me = enter_rank(payload)
    with rank_phase("build"):
        module = me.variant.build(...)
    with rank_phase("forward", step):
        out = me.variant.call(module, x)

:class:`rank_phase` marks the phase (an isolated worker names the phase of a rank that dies or
hangs, :func:`tpsim.mark_phase`) and turns whatever the variant raises into the
:class:`~tpsim.props.blame.VariantRaised` the parent sorts (:mod:`tpsim.props.blame`). A family that
trains (linear layers, modules) ends each step with :func:`trainer_step`: the trainer's sum of the
grads left partial, then SGD.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from tpsim.comm.board import mark_phase
from tpsim.props.blame import variant_raised
from tpsim.props.groups import tp_group
from tpsim.props.launch import variant_of
from tpsim.seeding import manual_seed

__all__ = ["LR", "TRAIN_STEPS", "ThisRank", "enter_rank", "rank_phase", "sgd_step", "trainer_step"]

#: SGD steps a training family's case runs (training equivalence compares the parameters after them).
TRAIN_STEPS = 3
#: SGD learning rate of those steps.
LR = 0.1


@dataclass
class ThisRank:
    """What a rank function knows about itself: the ``case``, the ``variant``, the ``data`` the parent
    drew, its tp ``group`` (a process group), the group's index ``g``, its ``rank`` in it and the
    group's size ``tp``."""

    case: Any
    variant: Any
    data: Any
    group: Any
    g: int
    rank: int
    tp: int


def enter_rank(payload: dict[str, Any]) -> ThisRank:
    """This rank of the world running ``payload["case"]``: its tp group (every rank creates every
    group, in the same order) and the variant; every rank seeded alike, as training scripts do before
    they build a model (replicas must agree)."""
    case = payload["case"]
    variant = variant_of(payload)
    group, g, rank, tp = tp_group(case, dist.get_rank())
    manual_seed(case.seed)
    return ThisRank(case, variant, payload.get("data"), group, g, rank, tp)


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


def trainer_step(module: torch.nn.Module, partial: Mapping[str, torch.nn.Parameter | None], group: Any, step: int,
                 summed: dict[str, torch.Tensor]) -> None:
    """What the trainer does after the backward of SGD step ``step``: sum over the tp ``group`` the
    grads the layer leaves partial (``partial``: name -> parameter, None when the module has no such
    parameter; Megatron's ``finalize_model_grads``) — every rank joins the sum, with zeros where its
    grad is None (the checks report the missing grad) — recording step 0's sums in ``summed``; then one
    SGD step (:func:`sgd_step`)."""
    for name, p in partial.items():
        if p is None:
            continue  # the loader already refused a missing parameter
        total = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(total, group=group)
        if p.grad is not None and step == 0:
            summed[name] = total.detach().clone()
    mark_phase("step", step)  # the harness's own code: an error in it is not the variant's
    sgd_step(module)


def _is_dtensor(t: Any) -> bool:
    # Only a module that imported DTensor holds one: never import torch.distributed.tensor here (seconds).
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(t, cls)


def sgd_step(module: torch.nn.Module) -> None:
    """One SGD step of learning rate :data:`LR` on every parameter that has a grad; the grads are dropped."""
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                if _is_dtensor(p):
                    # A plan's parameter, updated in its own placement: a grad DTensor left Partial (a
                    # sequence-parallel norm's weight) is redistributed first, as DTensor's optimizers do.
                    g = p.grad if tuple(p.grad.placements) == tuple(p.placements) else p.grad.redistribute(
                        p.device_mesh, p.placements)
                    p.to_local().add_(g.to_local(), alpha=-LR)
                else:
                    p.add_(p.grad, alpha=-LR)
            p.grad = None
