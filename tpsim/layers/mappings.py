"""Autograd-aware collective regions: the conjugate forward/backward pairs of tensor parallelism.

Each public function is one *region boundary*: a collective in forward whose conjugate runs in
backward, so that gradients stay correct without any hand-written communication in the layers.
Names read as verb + to/from + region (Megatron's convention), and come in pairs::

    function                                       forward                backward
    copy_to_tensor_parallel_region                 identity               all-reduce
    reduce_from_tensor_parallel_region             all-reduce             identity
    scatter_to_tensor_parallel_region              split last dim         all-gather last dim
    gather_from_tensor_parallel_region             all-gather last dim    split last dim
    scatter_to_sequence_parallel_region            split sequence dim     all-gather sequence dim
    gather_from_sequence_parallel_region           all-gather seq. dim    reduce-scatter seq. dim
    reduce_scatter_to_sequence_parallel_region     reduce-scatter seq.    all-gather sequence dim

Every function takes the process group explicitly (``None`` is torch's default group; when
``torch.distributed`` is not initialised, ``None`` means a single-process world) and uses only
the public ``torch.distributed`` API, so the same code runs on NCCL, gloo and tpsim's in-process
backend. On a group of size 1 every function returns its input and issues no collective.

Implementation rules, each the fix of a known class of bug:

- collectives run on ``.contiguous()`` buffers and the function *returns the buffer that was
  reduced* (never reduce a copy and return the original: Megatron-LM #5337);
- nothing is reduced in place on a tensor the caller may still hold (an upstream gradient can
  be shared by several branches of the graph);
- gathers use one flat ``all_gather_single`` buffer (``all_gather_into_tensor`` on older torch)
  and one rearranging copy, rather than a list ``all_gather`` of ``world_size`` tensors;
- shapes are checked before any collective, so a bad shape raises ``ValueError`` on every rank
  instead of leaving a peer waiting.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
]

Group = Any  # a torch.distributed ProcessGroup, or None for the default group


# --------------------------------------------------------------------------- group helpers


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def resolve_group(group: Group) -> Group:
    """The group a layer will use: ``group``, else the default (world) group, else None.

    None comes back only when ``torch.distributed`` is not initialised (a single process).
    """
    if group is not None:
        return group
    return dist.group.WORLD if _initialized() else None


def group_size(group: Group) -> int:
    """World size of ``group`` (1 when torch.distributed is not initialised and group is None)."""
    if group is None and not _initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's rank in ``group`` (0 when not initialised and group is None; -1 if not a member)."""
    if group is None and not _initialized():
        return 0
    return dist.get_rank(group)


def _size_and_rank(group: Group, name: str) -> tuple[int, int]:
    size, rank = group_size(group), group_rank(group)
    if size < 1 or rank < 0:
        raise ValueError(
            f"{name}: this process (global rank {dist.get_rank()}) is not a member of group={group!r}; "
            "call it only on the ranks of its tensor-parallel group"
        )
    return size, rank


def _normalize_dim(dim: int, ndim: int, name: str, shape: tuple[int, ...]) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name}: dim={dim!r} must be an int")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}: dim={dim} is out of range for an input of shape {shape}")
    return dim % ndim


def _check_tensor(input_: Any, name: str) -> None:
    if not isinstance(input_, torch.Tensor):
        raise TypeError(f"{name}: input must be a torch.Tensor, got {type(input_).__name__}")


# ------------------------------------------------------------- plain (non-autograd) collectives


def _all_gather_flat(output: torch.Tensor, input_: torch.Tensor, group: Group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input_, group=group)


def _reduce_scatter_flat(output: torch.Tensor, input_: torch.Tensor, group: Group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input_, group=group)


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum ``x`` over ``group`` into a fresh contiguous tensor and return that tensor."""
    out = x.clone(memory_format=torch.contiguous_format)
    if group_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out


def all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); returns a new tensor.

    One flat ``[world_size * numel]`` buffer is gathered, viewed as ``[world_size, *x.shape]``
    and rearranged with one copy (none at all when ``dim == 0``).
    """
    size = group_size(group)
    if size == 1:
        return x.clone(memory_format=torch.contiguous_format)
    dim = dim % x.dim()
    x = x.contiguous()
    flat = torch.empty(size * x.numel(), dtype=x.dtype, device=x.device)
    _all_gather_flat(flat, x.view(-1), group)
    stacked = flat.view(size, *x.shape)  # [ws, *x.shape]
    full_shape = (*x.shape[:dim], size * x.shape[dim], *x.shape[dim + 1 :])
    if dim == 0:
        return stacked.view(full_shape)
    # [ws, ..., d, ...] -> [..., ws, d, ...] -> [..., ws*d, ...]
    return stacked.movedim(0, dim).reshape(full_shape)


def split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's equal chunk of ``x`` along ``dim``, as a new contiguous tensor (no communication)."""
    size, rank = group_size(group), group_rank(group)
    if size == 1:
        return x
    dim = dim % x.dim()
    chunk = x.shape[dim] // size
    return x.narrow(dim, rank * chunk, chunk).contiguous()


def reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's equal chunk along ``dim`` (new contiguous tensor)."""
    size = group_size(group)
    if size == 1:
        return x.clone(memory_format=torch.contiguous_format)
    dim = dim % x.dim()
    # Bring ``dim`` to the front so that rank r's chunk is one contiguous run of the flat buffer.
    moved = x.movedim(dim, 0).contiguous()  # [S, *rest]
    out = torch.empty(moved.numel() // size, dtype=x.dtype, device=x.device)
    _reduce_scatter_flat(out, moved.view(-1), group)
    out = out.view(moved.shape[0] // size, *moved.shape[1:])  # [S/ws, *rest]
    return out.movedim(0, dim).contiguous()


# ------------------------------------------------------------------------ autograd functions


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        return all_reduce(input_, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToParallelRegion(torch.autograd.Function):
    """Split along ``dim`` forward, all-gather along ``dim`` backward."""

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return split(input_, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromParallelRegion(torch.autograd.Function):
    """All-gather along ``dim`` forward; split (``reduce_grad=False``) or reduce-scatter backward."""

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Group, dim: int, reduce_grad: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.reduce_grad = group, dim, reduce_grad
        return all_gather(input_, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.reduce_grad:
            return reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(input_, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather(grad, ctx.dim, ctx.group), None, None


# ---------------------------------------------------------------------------- public regions


def copy_to_tensor_parallel_region(input_: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter the tensor-parallel region with a replicated tensor.

    Forward: identity (every rank already holds the full ``input_``).
    Backward: all-reduce (sum) of the gradient over ``group``, so every rank gets the full
    gradient of the replicated input. Conjugate of :func:`reduce_from_tensor_parallel_region`.
    """
    _check_tensor(input_, "copy_to_tensor_parallel_region")
    size, _ = _size_and_rank(group, "copy_to_tensor_parallel_region")
    if size == 1:
        return input_
    return _CopyToTensorParallelRegion.apply(input_, group)


def reduce_from_tensor_parallel_region(input_: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave the tensor-parallel region by summing per-rank partial results.

    Forward: all-reduce (sum) over ``group``; returns the reduced tensor (contiguous, new).
    Backward: identity (the gradient of a sum is replicated to every summand).
    Conjugate of :func:`copy_to_tensor_parallel_region`.
    """
    _check_tensor(input_, "reduce_from_tensor_parallel_region")
    size, _ = _size_and_rank(group, "reduce_from_tensor_parallel_region")
    if size == 1:
        return input_
    return _ReduceFromTensorParallelRegion.apply(input_, group)


def _check_divisible(input_: torch.Tensor, dim: int, size: int, name: str) -> None:
    if input_.shape[dim] % size:
        raise ValueError(
            f"{name}: dim {dim} of input shape {tuple(input_.shape)} has size {input_.shape[dim]}, "
            f"which is not divisible by the tensor-parallel world size {size}"
        )


def scatter_to_tensor_parallel_region(input_: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter the tensor-parallel region by keeping this rank's slice of the last dim.

    Forward: split the last dim into ``world_size`` equal chunks, keep chunk ``rank`` (no
    communication). Backward: all-gather the gradient along the last dim.
    Conjugate of :func:`gather_from_tensor_parallel_region`. Raises ``ValueError`` when the
    last dim is not divisible by the group size.
    """
    name = "scatter_to_tensor_parallel_region"
    _check_tensor(input_, name)
    size, _ = _size_and_rank(group, name)
    if input_.dim() == 0:
        raise ValueError(f"{name}: input must have at least one dim, got a scalar")
    if size == 1:
        return input_
    _check_divisible(input_, input_.dim() - 1, size, name)
    return _ScatterToParallelRegion.apply(input_, group, -1)


def gather_from_tensor_parallel_region(input_: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave the tensor-parallel region by concatenating every rank's last-dim shard.

    Forward: all-gather along the last dim (rank order). Backward: split the gradient along the
    last dim and keep this rank's chunk. Conjugate of :func:`scatter_to_tensor_parallel_region`.
    """
    name = "gather_from_tensor_parallel_region"
    _check_tensor(input_, name)
    size, _ = _size_and_rank(group, name)
    if input_.dim() == 0:
        raise ValueError(f"{name}: input must have at least one dim, got a scalar")
    if size == 1:
        return input_
    return _GatherFromParallelRegion.apply(input_, group, -1, False)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group: Group, dim: int = -2) -> torch.Tensor:
    """Enter the sequence-parallel region by keeping this rank's slice of the sequence dim.

    Forward: split ``dim`` (default -2, the dim before the features) into equal chunks and keep
    chunk ``rank`` (no communication). Backward: all-gather the gradient along ``dim``.
    Raises ``ValueError`` when the sequence length is not divisible by the group size.
    """
    name = "scatter_to_sequence_parallel_region"
    _check_tensor(input_, name)
    size, _ = _size_and_rank(group, name)
    d = _normalize_dim(dim, input_.dim(), name, tuple(input_.shape))
    if size == 1:
        return input_
    _check_divisible(input_, d, size, name)
    return _ScatterToParallelRegion.apply(input_, group, d)


def gather_from_sequence_parallel_region(input_: torch.Tensor, group: Group, dim: int = -2) -> torch.Tensor:
    """Leave the sequence-parallel region: rebuild the full sequence from every rank's shard.

    Forward: all-gather along ``dim`` (default -2, the dim before the features), in rank order.
    Backward: reduce-scatter (sum, then keep this rank's chunk) of the gradient along ``dim``:
    the full-sequence gradient is a per-rank partial sum in a tensor-parallel layer.
    Conjugate of :func:`reduce_scatter_to_sequence_parallel_region`.
    """
    name = "gather_from_sequence_parallel_region"
    _check_tensor(input_, name)
    size, _ = _size_and_rank(group, name)
    d = _normalize_dim(dim, input_.dim(), name, tuple(input_.shape))
    if size == 1:
        return input_
    return _GatherFromParallelRegion.apply(input_, group, d, True)


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor, group: Group, dim: int = -2
) -> torch.Tensor:
    """Enter the sequence-parallel region from per-rank partial sums.

    Forward: reduce-scatter along ``dim`` (default -2): sum over ``group``, keep this rank's
    equal chunk of the sequence. Backward: all-gather the gradient along ``dim``.
    Conjugate of :func:`gather_from_sequence_parallel_region`. Raises ``ValueError`` when the
    sequence length is not divisible by the group size.
    """
    name = "reduce_scatter_to_sequence_parallel_region"
    _check_tensor(input_, name)
    size, _ = _size_and_rank(group, name)
    d = _normalize_dim(dim, input_.dim(), name, tuple(input_.shape))
    if size == 1:
        return input_
    _check_divisible(input_, d, size, name)
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group, d)
