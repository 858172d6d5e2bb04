"""PyTorch's own tensor parallelism, checked by tpsim: ``nn.Linear`` under ``RowwiseParallel``.

Each variant builds a plain ``nn.Linear`` from the master weight on every rank and parallelises it
with ``parallelize_module`` on a 1-D ``DeviceMesh`` over the tp group (``dtensor_common.py``; tpsim
reads the DTensor parameters' local shards itself). Check them with::

    tpsim check examples/dtensor_rowwise.py
    tpsim check examples/dtensor_rowwise.py:RowwiseParallel --backend gloo

======================  ==============================================  ======================
variant                 torch style                                     tpsim: input -> output
======================  ==============================================  ======================
``RowwiseParallel``     ``RowwiseParallel()``                           sharded -> reduced
``RowwiseReplicateIn``  ``RowwiseParallel(input_layouts=Replicate())``  replicated -> reduced
``RowwiseDTensorOut``   ``RowwiseParallel(use_local_output=False)``,    sharded -> reduced
                        output read with ``to_local()``
======================  ==============================================  ======================

The bias is ``Replicate()`` (DTensor adds it once, after the reduction): tpsim's ``R`` bias.
``RowwiseParallel(output_layouts=Shard(-1))`` (a reduce-scatter over the output features) has no
tpsim declaration yet: a row layer's output is ``partial`` or ``reduced`` (see docs/dtensor.md).

Restrictions (torch 2.13.0, see docs/dtensor.md): ``ROWWISE_LIMITS``: divisible cases,
feature sizes >= 2 and ``min_batch_dims=1``: ``RowwiseParallel`` without bias fails in backward on a
1-D input (``DTensor.from_local``'s backward: "dimensionality of sizes (2) must match
dimensionality of strides (1)").
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import RowwiseParallel as _RowwiseParallel

from tpsim.variant import Variant

# tpsim imports example files by path (also inside gloo workers): make the shared helper importable.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from dtensor_common import ROWWISE_LIMITS, local_output, parallel_linear  # noqa: E402

__all__ = ["TPSIM_VARIANTS"]


def _builder(make_style: Any) -> Any:
    def build(in_features: int, out_features: int, bias: bool, *, group: Any, master_weight: torch.Tensor,
              master_bias: torch.Tensor | None, dtype: torch.dtype, **_: Any) -> nn.Module:
        return parallel_linear(in_features, out_features, bias, group=group, master_weight=master_weight,
                               master_bias=master_bias, dtype=dtype, style=make_style())

    return build


def _variant(**fields: Any) -> Variant:
    # torch 2.13.0 limits, not bugs of the layer: see ROWWISE_LIMITS in dtensor_common.py
    return Variant(**ROWWISE_LIMITS, **fields)


RowwiseParallel = _variant(
    name="RowwiseParallel",
    kind="row",
    build=_builder(_RowwiseParallel),
    input="sharded",
    output="reduced",
    description="nn.Linear + RowwiseParallel(): feature-sharded input, all-reduced output, bias added once",
)
RowwiseReplicateIn = _variant(
    name="RowwiseReplicateIn",
    kind="row",
    build=_builder(lambda: _RowwiseParallel(input_layouts=Replicate())),
    input="replicated",
    output="reduced",
    description="nn.Linear + RowwiseParallel(input_layouts=Replicate()): DTensor slices the full input itself",
)
RowwiseDTensorOut = _variant(
    name="RowwiseDTensorOut",
    kind="row",
    build=_builder(lambda: _RowwiseParallel(use_local_output=False)),
    forward=local_output,
    input="sharded",
    output="reduced",
    description="nn.Linear + RowwiseParallel(use_local_output=False): a replicated DTensor output, read with to_local()",
)

TPSIM_VARIANTS = [RowwiseParallel, RowwiseReplicateIn, RowwiseDTensorOut]
