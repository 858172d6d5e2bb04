"""Plans and DTensor-parameter modules the plan tests check (correct ones and seeded bugs)."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
from plan_mlp import PLAN, SP_PLAN, GatedMLP, NormMLP  # noqa: E402

from tpsim import ModuleVariant  # noqa: E402

#: Hugging Face strings with the down projection planned column-parallel.
HF_DOWN_COLWISE = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "colwise"}
#: Hugging Face strings with the gate projection planned row-parallel.
HF_GATE_ROWWISE = {"gate_proj": "rowwise", "up_proj": "colwise", "down_proj": "rowwise"}
#: The output left a DTensor (use_local_output=False): read as its full tensor.
DTENSOR_OUT = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
               "down_proj": RowwiseParallel(use_local_output=False)}
#: A plan entry that names nothing in the module.
TYPO = {"gate_proj": "colwise", "up_proj": "colwise", "down_prj": "rowwise"}
NOT_A_PLAN = 42


def _mesh(group: Any) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, "cpu")


def _dtensor_mlp(hidden: int, ffn: int, *, group: Any, dtype: torch.dtype) -> nn.Module:
    return parallelize_module(GatedMLP(hidden, ffn).to(dtype), _mesh(group), dict(PLAN))


def _dense_mlp(hidden: int, ffn: int, *, dtype: torch.dtype) -> nn.Module:
    return GatedMLP(hidden, ffn).to(dtype)


#: A module variant whose builder returns DTensor parameters itself (no plan target involved).
DTENSOR_PARAMS = ModuleVariant(name="DTensorParams", build=_dtensor_mlp, dense=_dense_mlp, sizes=("hidden", "ffn"),
                               min_sizes=(2, 2))


def rank_skewed_norm(module: nn.Module, mesh: Any) -> nn.Module:
    """A sequence-parallel plan function whose norm weight differs by rank (the replicated DTensor
    parameter is not identical across ranks right after construction)."""
    with torch.no_grad():
        module.norm.weight.add_(float(mesh.get_local_rank()))
    return parallelize_module(module, mesh, SP_PLAN)


__all__ = ["DTENSOR_OUT", "DTENSOR_PARAMS", "HF_DOWN_COLWISE", "HF_GATE_ROWWISE", "NOT_A_PLAN", "NormMLP", "TORCH_TYPO", "TYPO",
           "rank_skewed_norm"]

#: A DTensor-style plan entry that names nothing in the module.
TORCH_TYPO = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_prj": RowwiseParallel()}
