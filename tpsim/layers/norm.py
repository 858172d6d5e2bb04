"""Norms for the sequence-parallel region: replicated parameters, sequence-sharded activations.

Under sequence parallelism a LayerNorm/RMSNorm runs between a row layer's reduce-scatter and the
next column layer's all-gather, on each rank's shard of the sequence. Its weight (and bias) are
replicated on every rank, but each rank sees only ``1/ws`` of the tokens, so its local parameter
gradient is a partial sum: without a reduction over the tensor-parallel group the replicas get
different gradients and drift apart (NeMo #7184, gpt-neox #1257).

How the reduction is done here: with ``sequence_parallel=True`` (the default, the reason these
classes exist) each parameter enters the forward through
:func:`~tpsim.layers.mappings.copy_to_tensor_parallel_region`, whose backward all-reduces the
gradient over ``group``. So ``.grad`` is already the full, identical gradient on every rank when
``backward()`` returns: no hook and no extra call before the optimizer step. The cost is one small
all-reduce per parameter per backward. With ``sequence_parallel=False`` the norm is a plain
replicated norm on replicated input and issues no collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tpsim.layers.linear import check_dtype, check_options, check_sequence_dim
from tpsim.layers.mappings import Group, _size_and_rank, copy_to_tensor_parallel_region, resolve_group

__all__ = ["LayerNorm", "RMSNorm"]


def _shape(normalized_shape: int | Sequence[int], owner: str) -> tuple[int, ...]:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"{owner}: normalized_shape={normalized_shape!r} must be a positive int or a tuple of them")
    return shape


def _copy_affine(src: nn.Module, dst: nn.Module) -> None:
    """Copy the affine parameters both norms have (a missing bias, e.g. RMSNorm's, is skipped)."""
    with torch.no_grad():
        for name in ("weight", "bias"):
            value, target = getattr(src, name, None), getattr(dst, name, None)
            if value is not None and target is not None:
                target.copy_(value)


def _factory_of(param: torch.Tensor | None) -> dict[str, Any]:
    """The ``dtype`` and ``device`` of a copy of a norm whose weight is ``param`` (None: the defaults)."""
    return {"dtype": None if param is None else param.dtype, "device": None if param is None else param.device}


class _SequenceParallelNorm(nn.Module):
    """Shared set-up: replicated affine parameters whose grads are all-reduced when sequence-parallel."""

    #: The parameters are replicated (no dim of them is sharded).
    partition_dim = None
    #: The keyword options ``from_dense`` passes on to the constructor.
    OPTIONS = ("sequence_parallel", "sequence_dim")

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None,
        elementwise_affine: bool,
        bias: bool,
        group: Group,
        sequence_parallel: bool,
        sequence_dim: int,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self.normalized_shape = _shape(normalized_shape, owner)
        dtype = check_dtype(dtype, owner)
        self.eps = eps
        self.elementwise_affine = bool(elementwise_affine)
        self.group = resolve_group(group)
        self.tp_world_size, self.tp_rank = _size_and_rank(self.group, owner)
        self.sequence_parallel = bool(sequence_parallel)
        self.sequence_dim = check_sequence_dim(sequence_dim, owner)
        if self.elementwise_affine:
            self.weight: nn.Parameter | None = nn.Parameter(torch.ones(self.normalized_shape, dtype=dtype, device=device))
            if bias:
                self.bias: nn.Parameter | None = nn.Parameter(
                    torch.zeros(self.normalized_shape, dtype=dtype, device=device)
                )
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def _param(self, p: torch.Tensor | None) -> torch.Tensor | None:
        if p is None or not self.sequence_parallel:
            return p
        return copy_to_tensor_parallel_region(p, self.group)  # backward: all-reduce of p's grad

    def _check(self, x: Any) -> None:
        owner = type(self).__name__
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{owner}: input must be a torch.Tensor, got {type(x).__name__}")
        n = len(self.normalized_shape)
        if x.dim() < n or tuple(x.shape[x.dim() - n :]) != self.normalized_shape:
            raise ValueError(
                f"{owner} expected an input whose last dims are normalized_shape={self.normalized_shape}, "
                f"got input shape {tuple(x.shape)}"
            )

    #: The dense ``torch.nn`` norm this class copies (:meth:`from_dense`, :meth:`to_dense`).
    DENSE: type[nn.Module]

    @staticmethod
    def _dense_args(norm: Any) -> tuple[Any, ...]:
        """The positional constructor arguments ``norm`` (this class or :attr:`DENSE`) was built with."""
        return norm.normalized_shape, norm.eps, norm.elementwise_affine

    @classmethod
    def from_dense(cls, norm: nn.Module, *, group: Group = None, **options: Any) -> Any:
        """A copy of a dense norm of class :attr:`DENSE` (replicated: no communication); ``options``:
        :attr:`OPTIONS`."""
        if not isinstance(norm, cls.DENSE):
            raise TypeError(f"{cls.__name__}.from_dense: norm must be a torch.nn.{cls.DENSE.__name__}, "
                            f"got {type(norm).__name__}")
        check_options(options, cls.OPTIONS, cls.__name__)
        layer = cls(*cls._dense_args(norm), group=group, **_factory_of(norm.weight), **options)
        _copy_affine(norm, layer)
        return layer

    def to_dense(self) -> nn.Module:
        """An equal norm of class :attr:`DENSE` (no communication: the parameters are replicated)."""
        dense = self.DENSE(*self._dense_args(self), **_factory_of(self.weight))
        _copy_affine(self, dense)
        return dense

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class LayerNorm(_SequenceParallelNorm):
    """``torch.nn.LayerNorm`` for the sequence-parallel region; parameter grads all-reduced over ``group``.

    Same arguments and initialisation as ``nn.LayerNorm`` (weight ones, bias zeros), plus
    ``group`` (``None``: the default group, resolved at construction) and ``sequence_parallel``
    (default True: the input is sequence-sharded, so the grads are all-reduced; see the module
    docstring). ``sequence_dim`` is recorded for tools describing the layer; the norm itself
    works on the last dims and does not depend on it.
    """

    DENSE = nn.LayerNorm

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        group: Group = None,
        sequence_parallel: bool = True,
        sequence_dim: int = -2,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(
            normalized_shape, eps, elementwise_affine, bias, group, sequence_parallel, sequence_dim, dtype, device
        )

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        self._check(input_)
        return F.layer_norm(input_, self.normalized_shape, self._param(self.weight), self._param(self.bias), self.eps)

    @staticmethod
    def _dense_args(norm: Any) -> tuple[Any, ...]:
        return norm.normalized_shape, norm.eps, norm.elementwise_affine, norm.bias is not None


class RMSNorm(_SequenceParallelNorm):
    """``torch.nn.RMSNorm`` for the sequence-parallel region; weight grad all-reduced over ``group``.

    Same arguments as ``nn.RMSNorm`` (``eps=None``: ``torch.finfo(dtype).eps``; weight ones), plus
    ``group``, ``sequence_parallel`` (default True) and ``sequence_dim`` as for :class:`LayerNorm`.
    """

    DENSE = nn.RMSNorm

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        *,
        group: Group = None,
        sequence_parallel: bool = True,
        sequence_dim: int = -2,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(
            normalized_shape, eps, elementwise_affine, False, group, sequence_parallel, sequence_dim, dtype, device
        )

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        self._check(input_)
        return F.rms_norm(input_, self.normalized_shape, self._param(self.weight), self.eps)
