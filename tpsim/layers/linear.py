"""Column- and row-parallel linear layers (Megatron's pattern, any backend, explicit group).

Shapes, with ``ws`` the tensor-parallel world size and ``r`` this rank::

    ColumnParallelLinear   weight [out/ws, in]   bias [out/ws]   in: [..., in] (replicated)
                                                                 out: [..., out/ws] (or [..., out])
    RowParallelLinear      weight [out, in/ws]   bias [out]      in: [..., in/ws] (or [..., in])
                                                                 out: [..., out] (replicated)

Both keep ``torch.nn.Linear``'s ``[out, in]`` layout, so a shard is a slice of the dense weight.

**Initialisation.** A layer draws the *full* master weight (and bias) exactly as
``torch.nn.Linear(in_features, out_features, dtype=dtype)`` draws them on the CPU (weight by
``kaiming_uniform_(a=sqrt(5))``, i.e. U(-1/sqrt(in), 1/sqrt(in)), then the bias from the same
range), from torch's default generator, then keeps this rank's slice and moves it to ``device``.
So with the same seed on every rank the layer *is* that ``nn.Linear``, sharded, at every world
size (``to_dense()`` gives it back). Seed every rank alike, as for any replicated init; the cost
is one full master weight per rank, once, at construction. ``from_dense`` draws nothing.

**Sharding description** (stable attributes, for tools that describe layers as placements):
``partition_dim`` (class attribute: the dim of the ``[out, in]`` weight that is sharded),
``parts`` (full sizes of the packed parts along that dim, in order), ``local_parts`` (the sizes
of this rank's shard of each part), ``sequence_parallel`` and ``sequence_dim``, ``gather_output``
(column) / ``input_is_parallel`` (row), ``group``, ``tp_world_size`` and ``tp_rank``; ``OPTIONS``
(class attribute) names the keyword options ``from_dense`` accepts.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tpsim.layers.mappings import (
    Group,
    _size_and_rank,
    all_gather,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    resolve_group,
    scatter_to_tensor_parallel_region,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]

_SKIP_INIT: contextvars.ContextVar[bool] = contextvars.ContextVar("tpsim_layers_skip_init", default=False)


@contextlib.contextmanager
def skip_init() -> Iterator[None]:
    """Build layers without drawing a master weight (``from_dense`` fills the parameters in)."""
    token = _SKIP_INIT.set(True)
    try:
        yield
    finally:
        _SKIP_INIT.reset(token)


# ------------------------------------------------------------------------------ validation


def check_positive_int(value: Any, name: str, owner: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {name}={value!r} must be an int (got {type(value).__name__})")
    if value < 1:
        raise ValueError(f"{owner}: {name}={value} must be >= 1")
    return value


def check_dtype(dtype: Any, owner: str) -> torch.dtype:
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{owner}: dtype={dtype!r} must be a floating-point torch.dtype (e.g. torch.float32)")
    return dtype


def check_sequence_dim(sequence_dim: Any, owner: str) -> int:
    if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
        raise TypeError(f"{owner}: sequence_dim={sequence_dim!r} must be an int")
    if sequence_dim == -1:
        raise ValueError(
            f"{owner}: sequence_dim=-1 is the feature dim; the sequence dim must come before the "
            "features (default -2, the dim just before them)"
        )
    return sequence_dim


def not_divisible(name: str, value: int, world_size: int, owner: str, what: str) -> ValueError:
    return ValueError(
        f"{name}={value} is not divisible by the tensor-parallel world size {world_size} ({owner} {what})"
    )


def sequence_dim_of(x: torch.Tensor, sequence_dim: int, owner: str) -> int:
    """Normalise ``sequence_dim`` for input ``x``; it must name a dim before the last (feature) dim."""
    shape = tuple(x.shape)
    if x.dim() < 2:
        raise ValueError(
            f"{owner}(sequence_parallel=True) needs an input with a sequence dim before the features, "
            f"got input shape {shape}"
        )
    d = sequence_dim + x.dim() if sequence_dim < 0 else sequence_dim
    if not 0 <= d < x.dim() - 1:
        raise ValueError(
            f"{owner}: sequence_dim={sequence_dim} does not name a dim before the feature dim "
            f"of input shape {shape}"
        )
    return d


def check_sequence_divisible(x: torch.Tensor, d: int, world_size: int, owner: str, what: str) -> None:
    if x.shape[d] % world_size:
        raise ValueError(
            f"{owner}: sequence length {x.shape[d]} (dim {d} of input shape {tuple(x.shape)}) is not "
            f"divisible by the tensor-parallel world size {world_size} ({what})"
        )


def check_input(x: Any, expected: int, owner: str, what: str, hint: str = "") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{owner}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] != expected:
        got = "a scalar" if x.dim() == 0 else f"last dim {x.shape[-1]}"
        raise ValueError(
            f"{owner} expected an input with last dim {what}, got {got} (input shape {tuple(x.shape)}){hint}"
        )


def draw_master(
    out_features: int, in_features: int, bias: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full weight and bias ``torch.nn.Linear(in_features, out_features, dtype=dtype)`` draws on the CPU."""
    weight = torch.empty(out_features, in_features, dtype=dtype)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    master_bias = None
    if bias:
        bound = 1 / math.sqrt(in_features)
        master_bias = torch.empty(out_features, dtype=dtype)
        nn.init.uniform_(master_bias, -bound, bound)
    return weight, master_bias


def empty_linear(linear_like: nn.Module, in_features: int, out_features: int, has_bias: bool) -> nn.Linear:
    """An ``nn.Linear`` with uninitialised storage (draws nothing from the RNG)."""
    ref = linear_like.weight
    return nn.Linear(in_features, out_features, bias=has_bias, device="meta", dtype=ref.dtype).to_empty(
        device=ref.device
    )


def check_dense(linear: Any, owner: str) -> nn.Linear:
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{owner}.from_dense: linear must be a torch.nn.Linear, got {type(linear).__name__}")
    return linear


def check_options(options: dict[str, Any], allowed: Sequence[str], owner: str) -> None:
    """``from_dense``'s ``**options``: only the constructor's layout options (sizes, dtype and device
    come from the dense module), with a message that names the offending key instead of Python's
    "got multiple values for keyword argument"."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(
            f"{owner}.from_dense: unexpected option(s) {', '.join(unknown)}; the options are "
            f"{', '.join(allowed)} (sizes, bias, dtype and device come from the dense module)"
        )


# ------------------------------------------------------------------------------ the layers


def _from_dense(cls: Any, linear: Any, group: Group, options: dict[str, Any], *, shard_bias: bool) -> Any:
    """Build ``cls``'s shard of a dense ``nn.Linear``: skip the random init, copy the master slices.

    A column layer shards its bias with the weight; a row layer keeps the full bias (added once,
    after the reduction).
    """
    check_dense(linear, cls.__name__)
    check_options(options, cls.OPTIONS, cls.__name__)
    with skip_init():
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            group=group,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
            **options,
        )
    with torch.no_grad():
        layer.weight.copy_(layer.shard(linear.weight))
        if layer.bias is not None:
            layer.bias.copy_(layer.shard(linear.bias) if shard_bias else linear.bias)
    return layer


class ColumnParallelLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W``'s output features (rows) sharded over the tensor-parallel group.

    Rank ``r`` holds ``weight`` ``[out_features/ws, in_features]`` and ``bias``
    ``[out_features/ws]``. The input is replicated (every rank passes the full ``x``); its
    gradient is all-reduced in backward (:func:`copy_to_tensor_parallel_region`), so every rank
    gets the full input gradient. The output is this rank's ``[..., out_features/ws]`` slice, or
    the full ``[..., out_features]`` on every rank with ``gather_output=True``.

    ``parts=(p0, p1, ...)`` packs several projections into one weight (gate/up: two parts; QKV:
    three, unequal for grouped-query attention, e.g. ``(q, kv, kv)``): each part is sharded on its
    own, so rank ``r`` holds shard ``r`` of every part, concatenated in part order (Megatron's
    partition stride), and ``y.split(local_parts, -1)`` gives this rank's shard of each part.
    Splitting the packed weight contiguously instead is a known bug (vllm #3775).

    ``sequence_parallel=True`` takes a sequence-sharded input (each rank holds ``1/ws`` of the
    sequence along ``sequence_dim``, by default -2, the dim before the features; for a 2-D input
    that is dim 0): it is all-gathered along the sequence in forward and the input gradient is
    reduce-scattered in backward (:func:`gather_from_sequence_parallel_region`).

    ``group``: the tensor-parallel process group; ``None`` is the default (world) group,
    resolved here at construction. Every argument error is a ``ValueError``/``TypeError`` raised
    at construction, on every rank, before any collective. See the module docstring for the
    initialisation.
    """

    #: Dim of the ``[out, in]`` weight that is sharded (the output features).
    partition_dim = 0
    #: The keyword options ``from_dense`` passes on to the constructor.
    OPTIONS = ("gather_output", "parts", "sequence_parallel", "sequence_dim")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Group = None,
        gather_output: bool = False,
        parts: Sequence[int] | None = None,
        sequence_parallel: bool = False,
        sequence_dim: int = -2,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        check_positive_int(in_features, "in_features", owner)
        check_positive_int(out_features, "out_features", owner)
        self.sequence_dim = check_sequence_dim(sequence_dim, owner)
        dtype = check_dtype(dtype, owner)
        self.parts = self._check_parts(parts, out_features, owner)
        self.group = resolve_group(group)
        self.tp_world_size, self.tp_rank = _size_and_rank(self.group, owner)
        ws = self.tp_world_size
        if len(self.parts) == 1:
            if out_features % ws:
                raise not_divisible("out_features", out_features, ws, owner, "shards out_features")
        else:
            for index, size in enumerate(self.parts):
                if size % ws:
                    raise ValueError(
                        f"parts[{index}]={size} is not divisible by the tensor-parallel world size {ws} "
                        f"({owner} shards each packed part on its own; parts={self.parts})"
                    )
        self.in_features = in_features
        self.out_features = out_features
        self.local_parts = tuple(size // ws for size in self.parts)
        self.gather_output = bool(gather_output)
        self.sequence_parallel = bool(sequence_parallel)
        local_out = out_features // ws
        self.weight = nn.Parameter(torch.empty(local_out, in_features, dtype=dtype, device=device))
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(local_out, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        if not _SKIP_INIT.get():
            self.reset_parameters()

    @staticmethod
    def _check_parts(parts: Sequence[int] | None, out_features: int, owner: str) -> tuple[int, ...]:
        if parts is None:
            return (out_features,)
        if isinstance(parts, (str, bytes)) or not isinstance(parts, Sequence) or len(parts) == 0:
            raise TypeError(f"{owner}: parts={parts!r} must be a non-empty sequence of ints, e.g. (8, 2, 2)")
        for index, size in enumerate(parts):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{owner}: parts[{index}]={size!r} must be an int >= 1 (parts={tuple(parts)!r})")
        parts = tuple(parts)
        if sum(parts) != out_features:
            raise ValueError(
                f"{owner}: parts={parts} sum to {sum(parts)}, but out_features={out_features}; "
                "the packed parts must add up to out_features"
            )
        return parts

    # -------------------------------------------------------------- shards <-> dense tensors

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full ``[out_features, ...]`` tensor (weight or bias); no communication."""
        ws, r = self.tp_world_size, self.tp_rank
        pieces = full.split(self.parts, dim=0)
        return torch.cat([p.narrow(0, r * (p.shape[0] // ws), p.shape[0] // ws) for p in pieces], dim=0)

    def _unshard(self, local: torch.Tensor) -> torch.Tensor:
        """Gather every rank's shard (collective) and undo the part interleaving."""
        stacked = all_gather(local.detach(), 0, self.group).view(self.tp_world_size, *local.shape)
        pieces = stacked.split(self.local_parts, dim=1)  # each [ws, p_k/ws, ...]
        return torch.cat([p.reshape(-1, *local.shape[1:]) for p in pieces], dim=0)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Redraw the master weight and bias (see the module docstring) and keep this rank's shard."""
        weight, bias = draw_master(self.out_features, self.in_features, self.bias is not None, self.weight.dtype)
        self.weight.copy_(self.shard(weight))
        if self.bias is not None and bias is not None:
            self.bias.copy_(self.shard(bias))

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, group: Group = None, **options: Any) -> ColumnParallelLinear:
        """This rank's shard of a dense ``nn.Linear`` (same dtype and device; no communication).

        ``options`` are the constructor's keyword options (``gather_output``, ``parts``,
        ``sequence_parallel``, ``sequence_dim``).
        """
        return _from_dense(cls, linear, group, options, shard_bias=True)

    @torch.no_grad()
    def to_dense(self) -> nn.Linear:
        """The full ``nn.Linear``, gathered onto every rank (a collective: call it on every rank)."""
        dense = empty_linear(self, self.in_features, self.out_features, self.bias is not None)
        dense.weight.copy_(self._unshard(self.weight))
        if self.bias is not None:
            dense.bias.copy_(self._unshard(self.bias))
        return dense

    # ---------------------------------------------------------------------------- forward

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        owner = type(self).__name__
        check_input(input_, self.in_features, owner, f"in_features={self.in_features}")
        if self.sequence_parallel:
            d = sequence_dim_of(input_, self.sequence_dim, owner)
            full = gather_from_sequence_parallel_region(input_, self.group, d)  # [..., S, ..., in]
        else:
            full = copy_to_tensor_parallel_region(input_, self.group)  # [..., in]
        output = F.linear(full, self.weight, self.bias)  # [..., out/ws]
        if not self.gather_output:
            return output
        output = gather_from_tensor_parallel_region(output, self.group)  # [..., ws * out/ws], rank-major
        if len(self.parts) > 1 and self.tp_world_size > 1:
            # rank-major [r0: p0 p1 .. | r1: p0 p1 .. | ..] -> part-major [p0 | p1 | ..]
            lead = output.shape[:-1]
            by_rank = output.reshape(*lead, self.tp_world_size, self.out_features // self.tp_world_size)
            output = torch.cat(
                [p.reshape(*lead, -1) for p in by_rank.split(self.local_parts, dim=-1)], dim=-1
            )
        return output

    def extra_repr(self) -> str:
        text = (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"tp_world_size={self.tp_world_size}, tp_rank={self.tp_rank}, gather_output={self.gather_output}"
        )
        if len(self.parts) > 1:
            text += f", parts={self.parts}"
        if self.sequence_parallel:
            text += f", sequence_parallel=True, sequence_dim={self.sequence_dim}"
        return text


class RowParallelLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W``'s input features (columns) sharded over the tensor-parallel group.

    Rank ``r`` holds ``weight`` ``[out_features, in_features/ws]`` and the *full* ``bias``
    ``[out_features]``. The input is this rank's ``[..., in_features/ws]`` slice
    (``input_is_parallel=True``, what a :class:`ColumnParallelLinear` without ``gather_output``
    returns) or the full ``[..., in_features]``, which is then split (``input_is_parallel=False``;
    its gradient is all-gathered in backward). Per-rank partial products are summed with one
    all-reduce (:func:`reduce_from_tensor_parallel_region`), and only then is the bias added,
    exactly once (adding it before the reduction counts it ``ws`` times). The output is replicated.

    ``sequence_parallel=True`` returns a sequence-sharded output instead: the partial products
    are reduce-scattered along ``sequence_dim`` (default -2; dim 0 for a 2-D input), the gradient
    is all-gathered in backward, and the bias is added once to each sequence shard. The bias is
    then a replicated parameter used on sharded data, so its gradient is all-reduced over the
    group in backward (it enters through :func:`copy_to_tensor_parallel_region`). The sequence
    length must be divisible by the group size (``ValueError`` otherwise, before any collective).

    ``group`` and argument errors as for :class:`ColumnParallelLinear`.
    """

    #: Dim of the ``[out, in]`` weight that is sharded (the input features).
    partition_dim = 1
    #: The keyword options ``from_dense`` passes on to the constructor.
    OPTIONS = ("input_is_parallel", "sequence_parallel", "sequence_dim")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Group = None,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = -2,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        check_positive_int(in_features, "in_features", owner)
        check_positive_int(out_features, "out_features", owner)
        self.sequence_dim = check_sequence_dim(sequence_dim, owner)
        dtype = check_dtype(dtype, owner)
        self.group = resolve_group(group)
        self.tp_world_size, self.tp_rank = _size_and_rank(self.group, owner)
        ws = self.tp_world_size
        if in_features % ws:
            raise not_divisible("in_features", in_features, ws, owner, "shards in_features")
        self.in_features = in_features
        self.out_features = out_features
        self.parts = (in_features,)
        self.local_parts = (in_features // ws,)
        self.input_is_parallel = bool(input_is_parallel)
        self.sequence_parallel = bool(sequence_parallel)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // ws, dtype=dtype, device=device))
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        if not _SKIP_INIT.get():
            self.reset_parameters()

    def shard(self, full_weight: torch.Tensor) -> torch.Tensor:
        """This rank's ``[out, in/ws]`` slice of a full ``[out, in]`` weight; no communication."""
        chunk = self.in_features // self.tp_world_size
        return full_weight.narrow(1, self.tp_rank * chunk, chunk)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Redraw the master weight and bias (see the module docstring) and keep this rank's shard."""
        weight, bias = draw_master(self.out_features, self.in_features, self.bias is not None, self.weight.dtype)
        self.weight.copy_(self.shard(weight))
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, group: Group = None, **options: Any) -> RowParallelLinear:
        """This rank's shard of a dense ``nn.Linear`` (same dtype and device; no communication).

        ``options`` are the constructor's keyword options (``input_is_parallel``,
        ``sequence_parallel``, ``sequence_dim``).
        """
        return _from_dense(cls, linear, group, options, shard_bias=False)

    @torch.no_grad()
    def to_dense(self) -> nn.Linear:
        """The full ``nn.Linear``, gathered onto every rank (a collective: call it on every rank)."""
        dense = empty_linear(self, self.in_features, self.out_features, self.bias is not None)
        dense.weight.copy_(all_gather(self.weight.detach(), 1, self.group))
        if self.bias is not None:
            dense.bias.copy_(self.bias)
        return dense

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        owner = type(self).__name__
        ws = self.tp_world_size
        if self.input_is_parallel:
            check_input(
                input_,
                self.in_features // ws,
                owner,
                f"in_features/world_size={self.in_features}/{ws}={self.in_features // ws} (input_is_parallel=True)",
                "; pass input_is_parallel=False to give it the full input" if ws > 1 else "",
            )
        else:
            check_input(input_, self.in_features, owner, f"in_features={self.in_features} (input_is_parallel=False)")
        d = 0
        if self.sequence_parallel:
            d = sequence_dim_of(input_, self.sequence_dim, owner)
            check_sequence_divisible(
                input_, d, ws, owner, "sequence_parallel=True reduce-scatters the output along the sequence dim"
            )
        local = input_ if self.input_is_parallel else scatter_to_tensor_parallel_region(input_, self.group)
        partial = F.linear(local, self.weight)  # [..., out], this rank's summand
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial, self.group, d)  # [..., S/ws, ..., out]
            bias = None if self.bias is None else copy_to_tensor_parallel_region(self.bias, self.group)
        else:
            output = reduce_from_tensor_parallel_region(partial, self.group)  # [..., out]
            bias = self.bias
        if bias is not None:
            output = output + bias  # once, after the reduction
        return output

    def extra_repr(self) -> str:
        text = (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"tp_world_size={self.tp_world_size}, tp_rank={self.tp_rank}, input_is_parallel={self.input_is_parallel}"
        )
        if self.sequence_parallel:
            text += f", sequence_parallel=True, sequence_dim={self.sequence_dim}"
        return text
