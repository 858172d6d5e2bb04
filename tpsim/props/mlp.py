"""Forward and gradient equivalence of a tensor-parallel MLP against the dense float64 MLP.

The lab note's check at its own scale (hidden 4096, intermediate 11008, tp 2, float32) runs in
seconds on the in-process backend::

    from tpsim.props.mlp import TPSIM_MLP, check_mlp
    failures = check_mlp(TPSIM_MLP, hidden=4096, intermediate=11008, world_size=2, dtype="float32")

An :class:`MLPVariant` describes a ``fc1 -> activation -> fc2`` MLP the Megatron way: ``fc1``
column-parallel (weight ``[intermediate, hidden]`` and bias ``S(0)``), ``fc2`` row-parallel
(weight ``[hidden, intermediate]`` ``S(1)``, bias replicated), replicated input and output; the
input's gradient must be complete on every rank. ``params`` maps each parameter's attribute path
on the built module to its master name and placement, so other module layouts can be described.

Tolerance: first-order error propagation through the composition, with the bound of
:mod:`tpsim.props.tolerance` (``C * eps * sqrt(K + ws) * M``) where ``K = hidden + intermediate +
rows`` and each ``M`` is the magnitude of the exact computation with every factor replaced by its
absolute value and the activation's error amplification bounded by ``|act'| <= 1.13`` and
``|act''| <= 0.8`` (true for GELU and SiLU; only these smooth activations are supported, since
ReLU's kink turns a rounding error in ``h`` into an O(1) gradient change).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpsim
from tpsim.diagnosis import Failure, close, mismatch, rank_summands, scale_factor
from tpsim.errors import InvalidArgument, RankError
from tpsim.placement import Placement, Replicate, Shard, shard_tensor
from tpsim.props.case import DTYPES
from tpsim.props.checks import BIAS_GRAD, FORWARD, INPUT_GRAD, WEIGHT_GRAD
from tpsim.props.tolerance import tolerance
from tpsim.variant import get_param

__all__ = ["MLPVariant", "MLP_ACTIVATIONS", "TPSIM_MLP", "check_mlp"]

#: Activations the MLP check supports: name -> float64 reference function (gated: of the gate half).
MLP_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "silu": F.silu,
    "swiglu": F.silu,
    "geglu": F.gelu,
}
#: Gated activations: ``act(gate) * up``, gate and up packed in fc1 (``Shard(0, parts=(1, 1))``).
GATED = frozenset({"swiglu", "geglu"})
_D1, _D2 = 1.13, 0.8  # bounds on |act'| and |act''| for GELU and SiLU

#: Megatron's placements: attribute path -> (master name, placement in master coordinates).
MEGATRON_MLP_PARAMS: dict[str, tuple[str, Placement]] = {
    "fc1.weight": ("w1", Shard(0)),
    "fc1.bias": ("b1", Shard(0)),
    "fc2.weight": ("w2", Shard(1)),
    "fc2.bias": ("b2", Replicate()),
}


@dataclass(frozen=True)
class MLPVariant:
    """A tensor-parallel MLP: ``build(hidden, intermediate, bias, *, group, rank, world_size,
    masters, dtype, activation, sequence_parallel, sequence_dim) -> nn.Module`` builds one rank's
    module (``masters``: ``w1`` ``[intermediate, hidden]`` (gated: ``[2*intermediate, hidden]``,
    gate rows first), ``b1``, ``w2`` ``[hidden, intermediate]``, ``b2`` in ``dtype``);
    ``load=True`` makes the harness copy every master shard into ``params`` after building.

    ``activation`` (None: the check's argument decides), ``sequence_parallel`` and
    ``sequence_dim`` describe the MLP: with sequence parallelism every rank is given, and must
    return, its slice of the sequence dim of the input and output. A gated MLP's fc1 placements
    get ``parts=(1, 1)`` (gate and up each sharded on their own) unless ``params`` says otherwise.
    """

    name: str
    build: Callable[..., nn.Module]
    params: Mapping[str, tuple[str, Placement]] = field(default_factory=lambda: dict(MEGATRON_MLP_PARAMS))
    load: bool = True
    target: str | None = None
    activation: str | None = None
    sequence_parallel: bool = False
    sequence_dim: int = -2

    # The attributes a ``tpsim check`` report lists for every checked variant.
    kind = "mlp"
    input_grad = "complete"
    bias = True
    notes = ()

    @property
    def input(self) -> str:
        return "sequence-sharded" if self.sequence_parallel else "replicated"

    @property
    def output(self) -> str:
        return "sequence-sharded" if self.sequence_parallel else "reduced"

    def describe(self) -> str:
        """One line: the MLP, its activation and sequence parallelism."""
        sp = f", sequence-parallel (dim {self.sequence_dim})" if self.sequence_parallel else ""
        return f"{self.name}: mlp fc1 column -> {self.activation or 'activation'} -> fc2 row{sp}, vs the dense MLP"

    def placements(self, activation: str) -> dict[str, tuple[str, Placement]]:
        """``params`` for ``activation``: a gated MLP's fc1 ``Shard(0)`` becomes ``Shard(0, parts=(1, 1))``."""
        out = dict(self.params)
        if activation in GATED:
            for name in ("fc1.weight", "fc1.bias"):
                master, placement = out.get(name, (None, None))
                if isinstance(placement, Shard) and placement.dim == 0 and placement.parts is None:
                    out[name] = (master, Shard(0, parts=(1, 1)))  # type: ignore[assignment]
        return out


def _build_tpsim(hidden: int, intermediate: int, bias: bool, *, group: Any, dtype: torch.dtype,
                 activation: str, sequence_parallel: bool = False, sequence_dim: int = -2, **_: Any) -> nn.Module:
    from tpsim.layers import ParallelMLP
    from tpsim.layers.linear import skip_init

    # No init: the harness loads the master shards, so drawing a 4096 x 11008 weight per rank
    # (about a second) would be wasted.
    with skip_init():
        return ParallelMLP(hidden, intermediate, activation=activation, bias=bias, group=group, dtype=dtype,
                           sequence_parallel=sequence_parallel, sequence_dim=sequence_dim)


#: tpsim's own :class:`tpsim.layers.ParallelMLP`.
TPSIM_MLP = MLPVariant("ParallelMLP", _build_tpsim, target="tpsim.props.mlp:TPSIM_MLP")


def _masters(hidden: int, intermediate: int, bias: bool, dtype: torch.dtype, seed: int,
             batch_shape: tuple[int, ...], gated: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        # float32 draws (float64 would double the memory of the 4096 x 11008 weights), scaled like
        # nn.Linear's init so activations stay O(1) at any width.
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    out = {
        "w1": draw((2 if gated else 1) * intermediate, hidden, scale=hidden**-0.5),
        "w2": draw(hidden, intermediate, scale=intermediate**-0.5),
        "x": draw(*batch_shape, hidden),
        "g": draw(*batch_shape, hidden),
    }
    if bias:
        out["b1"] = draw((2 if gated else 1) * intermediate, scale=0.1)
        out["b2"] = draw(hidden, scale=0.1)
    return out


def _rank_main(payload: dict[str, Any]) -> dict[str, Any]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    variant: MLPVariant = payload["variant"]
    m: dict[str, torch.Tensor] = payload["masters"]
    bias = "b1" in m
    module = variant.build(
        payload["hidden"], payload["intermediate"], bias, group=dist.group.WORLD, rank=rank, world_size=ws,
        masters=m, dtype=m["w1"].dtype, activation=payload["activation"],
        sequence_parallel=variant.sequence_parallel, sequence_dim=variant.sequence_dim,
    )
    params = {name: spec for name, spec in variant.placements(payload["activation"]).items() if spec[0] in m}
    for name, (master, placement) in params.items():
        p = get_param(module, name)
        want = shard_tensor(m[master], placement, rank, ws)
        if p is None or p.shape != want.shape:
            raise InvalidArgument(
                f"{variant.name}: parameter {name!r} has shape {None if p is None else list(p.shape)}, expected "
                f"{list(want.shape)} ({placement} of {master} over world_size={ws})"
            )
        if variant.load:
            with torch.no_grad():
                p.copy_(want)
    x, g = m["x"], m["g"]
    if variant.sequence_parallel:  # every rank is given its slice of the sequence, and its slice of the grad
        x, g = shard_tensor(x, Shard(variant.sequence_dim), rank, ws), shard_tensor(g, Shard(variant.sequence_dim), rank, ws)
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(g.to(y.dtype))
    grads = {}
    for name in params:
        p = get_param(module, name)
        grads[name] = None if p is None or p.grad is None else p.grad.detach().clone()
    return {"y": y.detach(), "dx": None if x.grad is None else x.grad.detach(), "grads": grads}


class _Outer:
    """A dense weight grad ``L^T @ R`` kept as its two thin factors (``rows`` x ...): a rank's shard
    is computed from the sliced factor, so no full-size float64 grad is ever materialised."""

    def __init__(self, left: torch.Tensor, right: torch.Tensor) -> None:
        self.left, self.right = left, right

    @property
    def shape(self) -> tuple[int, int]:
        return (self.left.shape[1], self.right.shape[1])

    def shard(self, placement: Placement, rank: int, ws: int) -> torch.Tensor:
        left, right = self.left, self.right
        if isinstance(placement, Shard):
            if placement.dim % 2 == 0:
                left = shard_tensor(left, Shard(1, placement.parts), rank, ws)
            else:
                right = shard_tensor(right, Shard(1, placement.parts), rank, ws)
        return left.t() @ right


def _reference(m: dict[str, torch.Tensor], activation: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Dense float64 values and float32 magnitudes (bounds need no more precision) of every checked tensor."""
    act = MLP_ACTIVATIONS[activation]
    f64 = torch.float64
    x, g = m["x"].to(f64), m["g"].to(f64)
    hidden = x.shape[-1]
    x2, g2 = x.reshape(-1, hidden), g.reshape(-1, hidden)
    w1, w2 = m["w1"].to(f64), m["w2"].to(f64)
    h = x2 @ w1.t()
    if "b1" in m:
        h = h + m["b1"].to(f64)
    gated = activation in GATED
    up = None
    if gated:  # fc1 packs [gate; up]: a = act(gate) * up
        h, up = h.chunk(2, dim=-1)
    h.requires_grad_(True)
    a = act(h)
    (d_act,) = torch.autograd.grad(a, h, torch.ones_like(a))  # act'(h), elementwise
    h, a = h.detach(), a.detach()
    s_gate = a  # act(gate) (ungated: the activation itself)
    if up is not None:
        a = s_gate * up
    y = a @ w2.t()
    if "b2" in m:
        y = y + m["b2"].to(f64)
    da = g2 @ w2
    if up is not None:
        dh = torch.cat([da * up * d_act, da * s_gate], dim=-1)  # [d gate, d up], packed like fc1's rows
    else:
        dh = da * d_act
    dx = dh @ w1
    del w1, w2
    ref: dict[str, Any] = {
        "y": y.reshape(g.shape),
        "dx": dx.reshape(x.shape),
        "fc1.weight": _Outer(dh, x2),
        "fc2.weight": _Outer(g2, a),
    }
    # Magnitudes (see the module docstring), in float32 from the float32 (or narrower) masters.
    f32 = torch.float32
    aw1, aw2 = m["w1"].to(f32).abs(), m["w2"].to(f32).abs()
    ax, ag = x2.to(f32).abs(), g2.to(f32).abs()
    m_h = ax @ aw1.t()
    if "b1" in m:
        m_h = m_h + m["b1"].to(f32).abs()
    m_da = ag @ aw2
    if up is not None:
        # First-order error propagation through a = s(gate) * up (s = act; |s'| <= D1, |s''| <= D2).
        m_g, m_u = m_h.chunk(2, dim=-1)
        s_abs, u_abs, da_abs = s_gate.to(f32).abs(), up.to(f32).abs(), da.to(f32).abs()
        m_a = a.to(f32).abs() + _D1 * m_g * u_abs + s_abs * m_u
        m_dh = torch.cat(
            [m_da * u_abs * _D1 + da_abs * _D1 * m_u + da_abs * u_abs * _D2 * m_g, m_da * s_abs + da_abs * _D1 * m_g],
            dim=-1,
        )
    else:
        m_a = a.to(f32).abs() + _D1 * m_h
        m_dh = _D1 * m_da + _D2 * da.to(f32).abs() * m_h
    m_y = m_a @ aw2.t()
    if "b2" in m:
        m_y = m_y + m["b2"].to(f32).abs()
    mag: dict[str, Any] = {
        "y": m_y.reshape(g.shape),
        "dx": (m_dh @ aw1).reshape(x.shape),
        "fc1.weight": _Outer(m_dh, ax),
        "fc2.weight": _Outer(ag, m_a),
    }
    if "b1" in m:
        ref["fc1.bias"], mag["fc1.bias"] = dh.sum(0), m_dh.sum(0)
        ref["fc2.bias"], mag["fc2.bias"] = g2.sum(0), ag.sum(0)
    return ref, mag


def check_mlp(
    variant: MLPVariant = TPSIM_MLP,
    *,
    hidden: int,
    intermediate: int,
    world_size: int,
    dtype: str = "float32",
    batch_shape: tuple[int, ...] = (2, 3),
    bias: bool = True,
    seed: int = 0,
    activation: str | None = None,
    backend: str = "inproc",
    timeout: float = 60.0,
) -> list[Failure]:
    """Run the MLP once on ``world_size`` ranks; return the failures of forward, input-grad, weight-grad
    and bias-grad equivalence (empty: equivalent). ``activation``: default the variant's, else gelu.
    With ``variant.sequence_parallel`` each rank gets and returns its slice of the sequence dim
    (``batch_shape``'s entry for ``variant.sequence_dim``) and a replicated parameter's grad that is
    only each rank's summand is ``grad-not-reduced``, naming the parameter. On gloo/nccl the variant
    is pickled to the worker processes (its ``build`` must be a module-level function)."""
    activation = activation or variant.activation or "gelu"
    if activation not in MLP_ACTIVATIONS:
        raise InvalidArgument(f"activation={activation!r}; the MLP check supports {', '.join(MLP_ACTIVATIONS)}")
    if dtype not in DTYPES:
        raise InvalidArgument(f"dtype={dtype!r}; expected one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    case = {"variant": variant.name, "hidden": hidden, "intermediate": intermediate, "world_size": world_size,
            "dtype": dtype, "batch_shape": list(batch_shape), "bias": bias, "seed": seed, "activation": activation}
    masters = _masters(hidden, intermediate, bias, torch_dtype, seed, tuple(batch_shape), activation in GATED)
    payload = {"variant": variant, "masters": masters, "hidden": hidden, "intermediate": intermediate,
               "activation": activation}
    try:
        values = tpsim.run(_rank_main, world_size, backend=backend, args=(payload,), timeout=timeout)
    except RankError as err:
        return [Failure(FORWARD, "exception", str(err).splitlines()[0], case=case, rank=err.rank,
                        traceback=err.remote_traceback or None, variant=variant.name)]
    rows = 1
    for s in batch_shape:
        rows *= s
    k = hidden + intermediate + rows
    ref, mag = _reference(masters, activation)

    def tol(magnitude: torch.Tensor) -> torch.Tensor:
        return tolerance(torch_dtype, magnitude, reduction_length=k, world_size=world_size)

    failures: list[Failure] = []

    def fail(prop: str, diagnosis: str, message: str, rank: int | None = None, **details: Any) -> None:
        failures.append(Failure(prop, diagnosis, message, case=case, rank=rank, variant=variant.name, details=details))

    # The output and the (complete) input grad: replicated on every rank, or (sequence parallelism)
    # each rank's slice of the sequence dim.
    seq = Shard(variant.sequence_dim) if variant.sequence_parallel else None
    for prop, key, what in ((FORWARD, "y", "the output"), (INPUT_GRAD, "dx", "the input grad")):
        got = [None if v[key] is None else v[key].to(torch.float64) for v in values]
        for r, gr in enumerate(got):
            want = ref[key] if seq is None else shard_tensor(ref[key], seq, r, world_size)
            t = tol(mag[key] if seq is None else shard_tensor(mag[key], seq, r, world_size))
            if gr is None or gr.shape != want.shape:
                fail(prop, "shape-error", f"{what} on rank {r} has shape {None if gr is None else list(gr.shape)}, "
                     f"expected {list(want.shape)}", r)
                break
            if close(gr, want, t):
                continue
            if seq is None and rank_summands([x for x in got if x is not None], ref[key], t):
                name = "missing-reduction" if key == "y" else "grad-not-reduced"
                fail(prop, name, f"{what} on rank {r} is only its own summand: the all-reduce is missing", r)
            elif (c := scale_factor(gr, want, t, known=(world_size, 1 / world_size))) is not None:
                fail(prop, "grad-scaled" if key == "dx" else "mismatch", f"{what} on rank {r} is {c:.4g} x the dense one", r,
                     factor=c)
            else:
                d = mismatch(gr, want, what=f"{what} on rank {r}")
                fail(prop, d.name, d.message, r, **d.details)
            break
    # Parameter grads: each rank's shard of the dense grad.
    for name, (master, placement) in variant.placements(activation).items():
        if master not in masters:
            continue
        prop = BIAS_GRAD if name.endswith("bias") else WEIGHT_GRAD
        if isinstance(placement, Replicate) and world_size > 1 and not isinstance(ref[name], _Outer):
            grads = [v["grads"].get(name) for v in values]
            t_full = tol(mag[name])
            if all(g is not None and g.shape == ref[name].shape for g in grads) and rank_summands(
                [g.to(torch.float64) for g in grads], ref[name], t_full
            ):
                fail(prop, "grad-not-reduced",
                     f"the {name} grad on rank 0 is only its own summand (the ranks' grads add up to the dense grad): "
                     f"the grad of the replicated parameter {name!r} is never all-reduced"
                     + (" (under sequence parallelism each rank uses it on its own slice of the sequence)"
                        if seq is not None else ""), 0, param=name)
                continue
        for r, v in enumerate(values):
            gr = v["grads"].get(name)
            if isinstance(ref[name], _Outer):
                want, t = ref[name].shard(placement, r, world_size), tol(mag[name].shard(placement, r, world_size))
            else:
                want = shard_tensor(ref[name], placement, r, world_size)
                t = tol(shard_tensor(mag[name], placement, r, world_size))
            if gr is None or gr.shape != want.shape:
                fail(prop, "shape-error", f"the {name} grad on rank {r} has shape {None if gr is None else list(gr.shape)}, "
                     f"expected {list(want.shape)}", r)
                break
            if not close(gr, want, t):
                c = scale_factor(gr.to(torch.float64), want, t, known=(world_size, 1 / world_size))
                if c is not None:
                    fail(prop, "grad-scaled", f"the {name} grad on rank {r} is {c:.4g} x the dense one", r, factor=c)
                else:
                    d = mismatch(gr, want, what=f"the {name} grad on rank {r}")
                    fail(prop, d.name, d.message, r, **d.details)
                break
    return failures
