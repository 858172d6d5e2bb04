"""Describing your own layer to tpsim: a variant for a layer no convention covers.

``ShardedProjection`` is a column-parallel layer with its own habits: keyword-only ``group`` and
``dtype``, its weight stored transposed under another name (``kernel``, ``[in, out/ws]``), its
bias called ``offset``, a ``use_bias`` flag, and a forward that takes a keyword (``gather=True``
returns the full output on every rank).

A :class:`tpsim.variant.Variant` says all of that once:

- ``build`` constructs the layer of one rank (tpsim passes the tp ``group``, ``rank``,
  ``world_size``, the case's ``dtype`` and the master tensors, which this layer does not need);
- ``params`` maps each parameter to its master tensor and placement in master coordinates
  (the weight as ``[out_features, in_features]``), with ``transposed=True`` for the stored
  layout; tpsim overwrites the layer's own initialisation with these shards;
- ``input``/``output``/``input_grad`` say what each rank is given and returns;
- ``forward`` calls the layer the way your code does.

Check it with::

    tpsim check examples/my_layer.py:projection
    tpsim check examples/my_layer.py:projection --backend gloo --world-sizes 2,4 --max-examples 20
"""

from __future__ import annotations

import torch
from torch import nn

from tpsim.layers import copy_to_tensor_parallel_region, gather_from_tensor_parallel_region
from tpsim.layers.mappings import group_rank, group_size
from tpsim.placement import Shard
from tpsim.variant import ParamSpec, Variant


class ShardedProjection(nn.Module):
    """``y = x @ kernel + offset`` over this rank's output features; optionally gathered."""

    def __init__(self, d_in: int, d_out: int, *, group=None, use_bias: bool = True, dtype=None):
        super().__init__()
        ws = group_size(group)
        if d_out % ws:
            raise ValueError(f"d_out={d_out} is not divisible by the tp size {ws}")
        self.group = group
        self.rank = group_rank(group)
        self.kernel = nn.Parameter(torch.randn(d_in, d_out // ws, dtype=dtype) / d_in**0.5)
        self.offset = nn.Parameter(torch.zeros(d_out // ws, dtype=dtype)) if use_bias else None

    def forward(self, x: torch.Tensor, *, gather: bool = False) -> torch.Tensor:
        y = copy_to_tensor_parallel_region(x, self.group) @ self.kernel
        if self.offset is not None:
            y = y + self.offset
        return gather_from_tensor_parallel_region(y, self.group) if gather else y


def build(in_features, out_features, bias, *, group, dtype, **_):
    return ShardedProjection(in_features, out_features, group=group, use_bias=bias, dtype=dtype)


projection = Variant(
    name="ShardedProjection",
    kind="column",
    build=build,
    input="replicated",
    output="gathered",
    input_grad="complete",
    params=(
        ParamSpec("kernel", "weight", Shard(0), transposed=True),  # stored [in, out/ws]
        ParamSpec("offset", "bias", Shard(0)),  # [out/ws]
    ),
    forward=lambda layer, x: layer(x, gather=True),
    description="a user's column-parallel projection with a transposed kernel, gathered output",
)
