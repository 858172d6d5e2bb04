"""A norm (LayerNorm) replicated across the tp group and run on sequence-sharded activations.

:class:`NormVariant` / :func:`check_norm` / :func:`search_norm`: each rank is given its slice of the
sequence; the output and input grad must be that slice of the dense norm's, and every replicated
parameter's grad must be the *full* dense grad on every rank. A grad that is only the rank's
summand (its own tokens) is ``grad-not-reduced``, naming the parameter (NeMo #7184,
gpt-neox #1257).

Cases here are small dicts (hidden size, world size, batch shape with the sequence dim, dtype,
seed), drawn from a seeded generator: these checks are deterministic for a seed and not
replayable with ``tpsim replay``. (MLPs and blocks are whole-module targets: :mod:`tpsim.props.module`.)
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpsim
from tpsim.diagnosis import (
    EXCEPTION,
    GRAD_MISSING,
    GRAD_NOT_REDUCED,
    GRAD_SCALED,
    SHAPE_ERROR,
    Failure,
    close,
    mismatch,
    rank_summands,
    scale_factor,
)
from tpsim.errors import InvalidArgument, RankError
from tpsim.placement import Shard, shard_tensor
from tpsim.props.case import DTYPES
from tpsim.props.checks import BIAS_GRAD, FORWARD, INPUT_GRAD, WEIGHT_GRAD
from tpsim.props.search import SearchReport
from tpsim.props.tolerance import tolerance
from tpsim.variant import get_param

__all__ = [
    "NORM_DTYPES",
    "NormVariant",
    "check_norm",
    "search_norm",
]

#: dtypes the norm check draws from (its tolerance is derived for these).
NORM_DTYPES = ("float64", "float32")


# --- sequence-parallel norms ----------------------------------------------------------------------


@dataclass(frozen=True)
class NormVariant:
    """A LayerNorm replicated across the tp group, run on sequence-sharded input.

    ``build(hidden, *, group, dtype) -> nn.Module`` builds one rank's norm; ``params`` names its
    replicated parameters (attribute paths: ``weight``, ``bias``), which the harness loads with the
    master values; ``sequence_dim`` is the sharded dim (default -2, dim 0 of a 2-D input).
    """

    name: str
    build: Callable[..., nn.Module]
    params: tuple[str, ...] = ("weight", "bias")
    sequence_dim: int = -2
    eps: float = 1e-5
    target: str | None = None


def _norm_rank(payload: dict[str, Any]) -> dict[str, Any]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    v: NormVariant = payload["variant"]
    m = payload["masters"]
    module = v.build(m["x"].shape[-1], group=dist.group.WORLD, dtype=m["x"].dtype)
    for name in v.params:
        p = get_param(module, name)
        if p is None or p.shape != m[name].shape:
            raise InvalidArgument(f"{v.name}: parameter {name!r} has shape {None if p is None else list(p.shape)}, "
                                  f"expected {list(m[name].shape)} (replicated)")
        with torch.no_grad():
            p.copy_(m[name])
    seq = Shard(v.sequence_dim)
    x = shard_tensor(m["x"], seq, rank, ws).clone().requires_grad_(True)
    y = module(x)
    y.backward(shard_tensor(m["g"], seq, rank, ws).to(y.dtype))
    grads = {n: None if get_param(module, n) is None or get_param(module, n).grad is None
             else get_param(module, n).grad.detach().clone() for n in v.params}
    return {"y": y.detach(), "dx": None if x.grad is None else x.grad.detach(), "grads": grads}


def check_norm(variant: NormVariant, *, hidden: int, world_size: int, batch_shape: tuple[int, ...],
               dtype: str = "float64", seed: int = 0, backend: str = "inproc", timeout: float = tpsim.DEFAULT_TIMEOUT) -> list[Failure]:
    """Run the norm once; return the failures of forward, input-grad and parameter-grad equivalence.

    Tolerance: the bound of :mod:`tpsim.props.tolerance` with reduction length ``hidden + rows``
    (the statistics reduce over ``hidden``, a parameter grad over the rows) on magnitudes taken
    from the float64 reference's absolute values (a norm's output is O(1) by construction).
    """
    if dtype not in DTYPES:
        raise InvalidArgument(f"dtype={dtype!r}; expected one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(seed)
    shape = (*batch_shape, hidden)
    masters = {
        "x": torch.randn(*shape, generator=gen, dtype=torch.float64).to(torch_dtype),
        "g": torch.randn(*shape, generator=gen, dtype=torch.float64).to(torch_dtype),
        "weight": (1 + 0.5 * torch.randn(hidden, generator=gen, dtype=torch.float64)).to(torch_dtype),
        "bias": (0.5 * torch.randn(hidden, generator=gen, dtype=torch.float64)).to(torch_dtype),
    }
    case = {"variant": variant.name, "hidden": hidden, "world_size": world_size, "batch_shape": list(batch_shape),
            "dtype": dtype, "seed": seed}
    try:
        values = tpsim.run(_norm_rank, world_size, backend=backend, args=({"variant": variant, "masters": masters},),
                           timeout=timeout)
    except RankError as err:
        return [Failure(FORWARD, EXCEPTION, str(err).splitlines()[0], case=case, rank=err.rank,
                        traceback=err.remote_traceback or None, variant=variant.name)]
    f64 = torch.float64
    x = masters["x"].to(f64).requires_grad_(True)
    w = masters["weight"].to(f64).requires_grad_(True)
    b = masters["bias"].to(f64).requires_grad_(True)
    y = F.layer_norm(x, (hidden,), w, b, variant.eps)
    y.backward(masters["g"].to(f64))
    rows = max(1, x.numel() // hidden)
    k = hidden + rows
    ref = {"y": y.detach(), "dx": x.grad, "weight": w.grad, "bias": b.grad}
    # Magnitudes: the exact computation with every factor replaced by its absolute value, where the
    # normalised x_hat = (x - mean) / sigma carries its inputs' rounding as (|x| + |mean|) / sigma.
    x0, g0 = masters["x"].to(f64), masters["g"].to(f64)
    mean = x0.mean(-1, keepdim=True)
    sigma = (x0.var(-1, unbiased=False, keepdim=True) + variant.eps).sqrt()
    xhat = ((x0 - mean) / sigma).abs()
    spread = (x0.abs() + mean.abs()) / sigma + xhat  # |x_hat| and its error amplification
    ghat = g0.abs() * w.detach().abs()
    mag_dx = (1 + spread) / sigma * (ghat + ghat.mean(-1, keepdim=True) + spread * (ghat * spread).mean(-1, keepdim=True))
    mag = {"y": spread * w.detach().abs() + b.detach().abs(), "dx": mag_dx,
           "weight": (g0.abs() * spread).reshape(-1, hidden).sum(0), "bias": g0.abs().reshape(-1, hidden).sum(0)}

    def tol(t: torch.Tensor) -> torch.Tensor:
        return tolerance(torch_dtype, t, reduction_length=k, world_size=world_size)

    failures: list[Failure] = []
    seq = Shard(variant.sequence_dim)
    for prop, key, what in ((FORWARD, "y", "the output"), (INPUT_GRAD, "dx", "the input grad")):
        for r, v in enumerate(values):
            got, want = v[key], shard_tensor(ref[key], seq, r, world_size)
            t = tol(shard_tensor(mag[key], seq, r, world_size))
            if got is None or got.shape != want.shape:
                failures.append(Failure(prop, SHAPE_ERROR, f"{what} on rank {r} has shape "
                                        f"{None if got is None else list(got.shape)}, expected {list(want.shape)}",
                                        case=case, rank=r, variant=variant.name))
                break
            if not close(got, want, t):
                d = mismatch(got, want, what=f"{what} on rank {r}", tol=t)
                failures.append(Failure(prop, d.name, d.message, case=case, rank=r, variant=variant.name,
                                        details=d.details))
                break
    for name in variant.params:
        prop = BIAS_GRAD if name == "bias" else WEIGHT_GRAD
        grads = [v["grads"].get(name) for v in values]
        want, t = ref[name], tol(mag[name])
        bad = [r for r, g in enumerate(grads) if g is None or g.shape != want.shape or not close(g, want, t)]
        if not bad:
            continue
        r = bad[0]
        g = grads[r]
        if g is None or g.shape != want.shape:
            failures.append(Failure(prop, GRAD_MISSING if g is None else SHAPE_ERROR,
                                    f"the {name} grad on rank {r} is {None if g is None else list(g.shape)}, expected "
                                    f"{list(want.shape)}", case=case, rank=r, variant=variant.name))
        elif all(x is not None for x in grads) and rank_summands([x.to(f64) for x in grads], want, t):
            failures.append(Failure(
                prop, GRAD_NOT_REDUCED,
                f"the {name} grad on rank {r} is only its own summand (the ranks' grads add up to the dense grad): the "
                f"grad of the replicated parameter {name!r} is never all-reduced over the tp group; under sequence "
                "parallelism each rank normalises only its own tokens (NeMo #7184, gpt-neox #1257)",
                case=case, rank=r, variant=variant.name, details={"param": name}))
        elif (c := scale_factor(g, want, t, known=(world_size, 1 / world_size))) is not None:
            failures.append(Failure(prop, GRAD_SCALED, f"the {name} grad on rank {r} is {c:.4g} x the dense one",
                                    case=case, rank=r, variant=variant.name, details={"factor": c}))
        else:
            d = mismatch(g, want, what=f"the {name} grad on rank {r}", tol=t)
            failures.append(Failure(prop, d.name, d.message, case=case, rank=r, variant=variant.name, details=d.details))
    return failures


def search_norm(variant: NormVariant, *, world_sizes: Sequence[int] = (1, 2, 3, 4), dtypes: Sequence[str] = NORM_DTYPES,
                max_examples: int = 20, seed: int = 0, backend: str = "inproc", timeout: float = tpsim.DEFAULT_TIMEOUT) -> SearchReport:
    """Check ``variant`` on up to ``max_examples`` small cases (2-D and 3-D inputs, a few tokens per
    rank); stops at the first failing case."""
    started = time.monotonic()
    rng = random.Random(seed)
    failures: list[Failure] = []
    n = 0
    for n in range(1, max_examples + 1):
        ws = rng.choice(list(world_sizes))
        batch = tuple([rng.randint(1, 3) for _ in range(rng.randint(0, 1))] + [ws * rng.randint(1, 3)])
        failures = check_norm(variant, hidden=rng.randint(2, 8), world_size=ws, batch_shape=batch,
                              dtype=rng.choice([d for d in NORM_DTYPES if d in dtypes] or ["float64"]),
                              seed=rng.randrange(2**31), backend=backend, timeout=timeout)
        if failures:
            for f in failures:
                f.found_after = n
            break
    return SearchReport(passed=not failures, examples=n, failures=failures, seconds=time.monotonic() - started,
                        notes=[], variant=variant.name)
