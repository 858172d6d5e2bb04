"""The tensor-parallel MLP (column -> activation -> row) and its dense twin.

::

    x [..., hidden] (replicated, or sequence-sharded with sequence_parallel=True)
      -> fc1: ColumnParallelLinear(hidden, intermediate)      [..., intermediate/ws]   (no collective)
         gated: fc1 packs [gate; up], parts=(intermediate, intermediate) -> [..., 2*intermediate/ws]
      -> activation (elementwise, per rank)                    [..., intermediate/ws]
         gated: act(gate) * up
      -> fc2: RowParallelLinear(intermediate, hidden)          [..., hidden]            (one all-reduce)

Without sequence parallelism that is exactly one all-reduce in forward (fc2's reduction) and
one in backward (fc1's input gradient). With ``sequence_parallel=True`` the pair becomes an
all-gather and a reduce-scatter each way (plus, with a bias, one small all-reduce of fc2's bias
gradient in backward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tpsim.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    check_dtype,
    check_input,
    check_options,
    check_positive_int,
    check_sequence_dim,
    not_divisible,
    skip_init,
)
from tpsim.layers.mappings import Group, _size_and_rank, resolve_group

__all__ = ["ACTIVATIONS", "GATED_ACTIVATIONS", "DenseMLP", "ParallelMLP"]

Activation = Callable[[torch.Tensor], torch.Tensor]

#: Named activations: name -> elementwise function. A gated name applies it to the gate half.
ACTIVATIONS: dict[str, Activation] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "geglu": F.gelu,
    "swiglu": F.silu,
}

#: The gated names: ``act(gate) * up`` with gate and up packed in one column layer.
GATED_ACTIVATIONS = frozenset({"geglu", "swiglu"})


def _resolve_activation(activation: Any, owner: str) -> tuple[Activation, bool]:
    if isinstance(activation, str):
        if activation not in ACTIVATIONS:
            names = ", ".join(repr(n) for n in ACTIVATIONS)
            raise ValueError(f"{owner}: activation={activation!r} is not one of {names} (or an elementwise callable)")
        return ACTIVATIONS[activation], activation in GATED_ACTIVATIONS
    if callable(activation):
        return activation, False
    raise TypeError(f"{owner}: activation={activation!r} must be a name ({', '.join(ACTIVATIONS)}) or a callable")


def _apply(fc1_out: torch.Tensor, fn: Activation, gated: bool) -> torch.Tensor:
    if not gated:
        return fn(fc1_out)
    gate, up = fc1_out.chunk(2, dim=-1)
    return fn(gate) * up


class DenseMLP(nn.Module):
    """The single-device MLP that :class:`ParallelMLP` shards: ``fc2(act(fc1(x)))``.

    For a gated activation (``"swiglu"``, ``"geglu"``) ``fc1`` is ``nn.Linear(hidden,
    2*intermediate)`` whose first ``intermediate`` rows are the gate and the rest the up
    projection, and the MLP is ``fc2(act(gate(x)) * up(x))``. Built like any ``nn.Linear``
    (torch's default init); :meth:`ParallelMLP.to_dense` returns one, :meth:`ParallelMLP.from_dense`
    shards one.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        *,
        activation: str | Activation = "gelu",
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        check_positive_int(hidden, "hidden", owner)
        check_positive_int(intermediate, "intermediate", owner)
        self._fn, self.gated = _resolve_activation(activation, owner)
        self.activation = activation
        self.hidden, self.intermediate = hidden, intermediate
        factory = {"dtype": dtype, "device": device}
        self.fc1 = nn.Linear(hidden, (2 if self.gated else 1) * intermediate, bias=bias, **factory)
        self.fc2 = nn.Linear(intermediate, hidden, bias=bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(_apply(self.fc1(x), self._fn, self.gated))


class ParallelMLP(nn.Module):
    """Megatron's tensor-parallel MLP: ``fc1`` column-parallel, elementwise activation, ``fc2`` row-parallel.

    ``activation``: ``"gelu"`` (exact), ``"relu"``, ``"silu"``, an elementwise callable, or a
    gated name, ``"swiglu"`` (``silu(gate) * up``) or ``"geglu"`` (``gelu(gate) * up``), for which
    ``fc1`` packs gate and up (``parts=(intermediate, intermediate)``) so each rank holds
    matching gate and up shards. The activation must be elementwise: it runs on each rank's
    shard of the intermediate features.

    Exactly one all-reduce in forward and one in backward; ``sequence_parallel=True`` takes and
    returns sequence-sharded activations instead (see the module docstring). Initialisation:
    ``fc1`` is drawn as ``nn.Linear(hidden, intermediate)`` (gated: ``nn.Linear(hidden,
    2*intermediate)``), then ``fc2`` as ``nn.Linear(intermediate, hidden)``, each as described
    in :mod:`tpsim.layers.linear`, so a seed gives the same MLP at every world size.

    ``intermediate`` must be divisible by the group size (``ValueError`` at construction, on
    every rank, before any collective); for a gated MLP that is the size of *each* packed part,
    not of the packed ``2*intermediate`` (checking the latter is torchtitan #4535).
    """

    #: The keyword options ``from_dense`` passes on to the constructor.
    OPTIONS = ("sequence_parallel", "sequence_dim")

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        *,
        activation: str | Activation = "gelu",
        bias: bool = True,
        group: Group = None,
        sequence_parallel: bool = False,
        sequence_dim: int = -2,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        check_positive_int(hidden, "hidden", owner)
        check_positive_int(intermediate, "intermediate", owner)
        check_sequence_dim(sequence_dim, owner)
        check_dtype(dtype, owner)
        self._fn, self.gated = _resolve_activation(activation, owner)
        self.group = resolve_group(group)
        self.tp_world_size, self.tp_rank = _size_and_rank(self.group, owner)
        if intermediate % self.tp_world_size:
            raise not_divisible("intermediate", intermediate, self.tp_world_size, owner, "shards intermediate")
        self.activation = activation
        self.hidden, self.intermediate = hidden, intermediate
        self.sequence_parallel = bool(sequence_parallel)
        self.sequence_dim = sequence_dim
        common: dict[str, Any] = {
            "group": self.group,
            "sequence_parallel": self.sequence_parallel,
            "sequence_dim": sequence_dim,
            "dtype": dtype,
            "device": device,
        }
        self.fc1 = ColumnParallelLinear(
            hidden,
            (2 if self.gated else 1) * intermediate,
            bias,
            parts=(intermediate, intermediate) if self.gated else None,
            **common,
        )
        self.fc2 = RowParallelLinear(intermediate, hidden, bias, input_is_parallel=True, **common)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        check_input(input_, self.hidden, type(self).__name__, f"hidden={self.hidden}")
        return self.fc2(_apply(self.fc1(input_), self._fn, self.gated))

    @classmethod
    def from_dense(cls, mlp: DenseMLP, *, group: Group = None, **options: Any) -> ParallelMLP:
        """This rank's shard of a :class:`DenseMLP` (no communication).

        ``options`` are the constructor's keyword options (``sequence_parallel``, ``sequence_dim``).
        """
        if not isinstance(mlp, DenseMLP):
            raise TypeError(f"{cls.__name__}.from_dense: mlp must be a DenseMLP, got {type(mlp).__name__}")
        check_options(options, cls.OPTIONS, cls.__name__)
        with skip_init():
            layer = cls(
                mlp.hidden,
                mlp.intermediate,
                activation=mlp.activation,
                bias=mlp.fc1.bias is not None,
                group=group,
                dtype=mlp.fc1.weight.dtype,
                device=mlp.fc1.weight.device,
                **options,
            )
        with torch.no_grad():
            for name in ("fc1", "fc2"):
                mine, dense = getattr(layer, name), getattr(mlp, name)
                mine.weight.copy_(mine.shard(dense.weight))
                if mine.bias is not None:
                    mine.bias.copy_(mine.shard(dense.bias) if name == "fc1" else dense.bias)
        return layer

    @torch.no_grad()
    def to_dense(self) -> DenseMLP:
        """The full :class:`DenseMLP`, gathered onto every rank (collectives: call it on every rank)."""
        weight = self.fc1.weight
        with torch.device("meta"):
            dense = DenseMLP(
                self.hidden,
                self.intermediate,
                activation=self.activation,
                bias=self.fc1.bias is not None,
                dtype=weight.dtype,
            )
        dense = dense.to_empty(device=weight.device)
        dense.fc1 = self.fc1.to_dense()
        dense.fc2 = self.fc2.to_dense()
        return dense

    def extra_repr(self) -> str:
        name = self.activation if isinstance(self.activation, str) else getattr(self.activation, "__name__", "callable")
        text = f"hidden={self.hidden}, intermediate={self.intermediate}, activation={name!r}"
        if self.sequence_parallel:
            text += f", sequence_parallel=True, sequence_dim={self.sequence_dim}"
        return text
