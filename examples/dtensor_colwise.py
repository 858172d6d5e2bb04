"""PyTorch's own tensor parallelism, checked by tpsim: ``nn.Linear`` under ``ColwiseParallel``.

Each variant builds a plain ``nn.Linear`` from the master weight on every rank, then hands it to
``torch.distributed.tensor.parallel.parallelize_module`` on a 1-D ``DeviceMesh`` over the tp
group: exactly what a user's training script does. Check them with::

    tpsim check examples/dtensor_colwise.py                 # every variant below, inproc
    tpsim check examples/dtensor_colwise.py:ColwiseParallel --backend gloo

DTensor parameters report their *global* shape; tpsim reads each one's local shard (with its
gradient) through :func:`tpsim.variant.get_param`, so the parameter specs name the parameters
as for any layer. Every variant declares the restrictions torch 2.13.0's DTensor needs
(``DTENSOR_LIMITS`` in ``dtensor_common.py``: divisible cases only, feature sizes >= 2). Layouts:

=======================  ===============================================  ============================
variant                  torch style                                      tpsim: input -> output
=======================  ===============================================  ============================
``ColwiseParallel``      ``ColwiseParallel()``                            replicated -> sharded
``ColwiseReplicateOut``  ``ColwiseParallel(output_layouts=Replicate())``  replicated -> gathered
``ColwiseDTensorOut``    ``ColwiseParallel(use_local_output=False)``,     replicated -> gathered
                         output read with ``full_tensor()``
``ColwiseShardedIn``     ``ColwiseParallel(input_layouts=Shard(-1),``     sharded -> full output
                         ``output_layouts=Replicate())``
=======================  ===============================================  ============================

The last one takes a sharded input, which tpsim's description only allows for ``kind="row"``; it
is declared as a row-kind layer whose weight is ``S(0)`` (the placements, not the kind, drive the
checks).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel as _ColwiseParallel

from tpsim.placement import Shard as TpShard
from tpsim.variant import ParamSpec, Variant

# The dtensor_* examples share their helpers in dtensor_common.py next to this file; tpsim imports
# example files by path (also inside gloo workers), so make the folder importable.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from dtensor_common import DTENSOR_LIMITS, full_output, parallel_linear  # noqa: E402

__all__ = ["TPSIM_VARIANTS"]


def _builder(make_style: Any) -> Any:
    def build(in_features: int, out_features: int, bias: bool, *, group: Any, master_weight: torch.Tensor,
              master_bias: torch.Tensor | None, dtype: torch.dtype, **_: Any) -> nn.Module:
        return parallel_linear(in_features, out_features, bias, group=group, master_weight=master_weight,
                               master_bias=master_bias, dtype=dtype, style=make_style())

    return build


def _variant(**fields: Any) -> Variant:
    # torch 2.13.0 limits, not bugs of the layer: see DTENSOR_LIMITS in dtensor_common.py
    return Variant(**DTENSOR_LIMITS, **fields)


ColwiseParallel = _variant(
    name="ColwiseParallel",
    kind="column",
    build=_builder(_ColwiseParallel),
    input="replicated",
    output="sharded",
    description="nn.Linear + ColwiseParallel(): replicated input, local output shard (use_local_output=True)",
)
ColwiseReplicateOut = _variant(
    name="ColwiseReplicateOut",
    kind="column",
    build=_builder(lambda: _ColwiseParallel(output_layouts=Replicate())),
    input="replicated",
    output="gathered",
    description="nn.Linear + ColwiseParallel(output_layouts=Replicate()): the output all-gathered by DTensor",
)
ColwiseDTensorOut = _variant(
    name="ColwiseDTensorOut",
    kind="column",
    build=_builder(lambda: _ColwiseParallel(use_local_output=False)),
    forward=full_output,
    input="replicated",
    output="gathered",
    description="nn.Linear + ColwiseParallel(use_local_output=False): a DTensor output, read with full_tensor()",
)
ColwiseShardedIn = _variant(
    name="ColwiseShardedIn",
    kind="row",
    build=_builder(lambda: _ColwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())),
    input="sharded",
    output="reduced",
    params=(ParamSpec("weight", "weight", TpShard(0)), ParamSpec("bias", "bias", TpShard(0))),
    description="nn.Linear + ColwiseParallel with a feature-sharded input (all-gathered by DTensor) and a "
    "replicated output; declared row-kind because tpsim's column kind takes a replicated input",
)

TPSIM_VARIANTS = [ColwiseParallel, ColwiseReplicateOut, ColwiseDTensorOut, ColwiseShardedIn]
