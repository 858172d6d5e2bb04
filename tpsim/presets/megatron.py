"""The Megatron-core preset: ``tpsim check megatron.core.tensor_parallel`` and subclasses of its layers.

Tested with ``megatron-core==0.16.1`` (the last line that runs on Python 3.11). For each rank the
preset

- builds a ``ModelParallelConfig`` with CPU initialisation (``use_cpu_initialization=True``), no
  gradient-accumulation fusion (it needs the APEX CUDA extension), ``params_dtype`` the case's
  dtype, ``sequence_parallel`` as the variant says and ``tensor_model_parallel_size`` the tp size;
- initialises the parallel state the layers read: ``parallel_state``'s tensor-parallel group (so
  ``get_tensor_model_parallel_group/rank/world_size()`` answer, for subclasses that call them) and
  a fresh global memory buffer (the sequence-parallel all-gather writes into it). The layers get
  the tp group explicitly (``tp_group=``), so tp groups smaller than the world, consecutive or
  strided, are checked. ``initialize_model_parallel`` itself is not run: it builds data, pipeline,
  context and expert groups these layers never use and fixes the tp groups to consecutive ranks.
  ``parallel_state`` is rank-local on inproc (each rank thread has its own, as each process does);
- constructs the layer with its own init (overwritten with the master shards), weight
  ``[out/tp, in]`` (column) / ``[out, in/tp]`` (row);
- calls ``forward`` and adds the returned bias of ``skip_bias_add`` (``(output, bias)`` tuples).

Input limits, from the layers' docstrings and code: inputs are 2-D ``[s, h]`` or 3-D ``[s, b, h]``,
sequence first (``min_batch_dims=1, max_batch_dims=2``; the weight-grad GEMM flattens 3-D only);
sequence parallelism shards dim 0 and needs a tp group of at least 2 (``ModelParallelConfig``
refuses it otherwise), so those variants declare ``min_tp_size=2``. Under sequence parallelism the
row layer's bias grad is a per-rank summand marked ``bias.sequence_parallel = True`` that
Megatron's trainer all-reduces (``finalize_model_grads``): tpsim treats it as trainer-reduced.

**The CPU shim.** Megatron allocates the output buffers of its gathers and reduce-scatters with
``device=torch.cuda.current_device()``, which fails on a machine without CUDA. Where CUDA is not
available, the preset gives four modules (``mappings``, ``layers`` and ``utils`` of
``megatron.core.tensor_parallel``, and ``megatron.core.utils``, whose global memory buffer holds the
sequence-parallel all-gather) a view of ``torch`` whose ``cuda.current_device()`` is the CPU device;
every other name is torch's own. The buffers then live where the tensors do, which is what the call
means on a GPU. Nothing else changes. The combinations that take this route are listed in
docs/presets.md (``gather_output``, ``input_is_parallel=False``, ``sequence_parallel``).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

from tpsim.conventions import add_returned_bias, own_module_state
from tpsim.placement import Replicate, Shard
from tpsim.presets._base import LibraryMissing, option_name, quiet_import, route_rank_warnings
from tpsim.variant import ParamSpec, Variant

__all__ = ["PRESET", "MegatronPreset", "cpu_shim_installed"]

_LAYERS = "megatron.core.tensor_parallel.layers"
_COLUMN = f"{_LAYERS}.ColumnParallelLinear"
_ROW = f"{_LAYERS}.RowParallelLinear"
#: The modules whose ``torch.cuda.current_device()`` calls the CPU shim answers.
SHIMMED_MODULES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.utils",  # GlobalMemoryBuffer.get_tensor: the sequence-parallel all-gather buffer
)
_PARALLEL_STATE = "megatron.core.parallel_state"
#: Megatron's default ``init_method_std``; the layer's own init is overwritten with the master anyway.
_INIT_STD = 0.02

#: Column options: (gather_output, skip_bias_add, sequence_parallel, disable_grad_reduce). Left out:
#: gather_output with skip_bias_add (the layer returns its bias shard beside the gathered output,
#: which no caller can add) and disable_grad_reduce under sequence parallelism (the flag has no
#: effect there: the reduce-scatter in backward is the sequence-parallel one).
_COLUMN_OPTIONS = [
    dict(gather_output=g, skip_bias_add=s, sequence_parallel=sp, disable_grad_reduce=d)
    for sp in (False, True)
    for d in ((False, True) if not sp else (False,))
    for g in (False, True)
    for s in (False, True)
    if not (g and s)
]
#: Row options: (input_is_parallel, skip_bias_add, sequence_parallel); sequence parallelism needs
#: input_is_parallel=True (the layer raises otherwise).
_ROW_OPTIONS = [
    dict(input_is_parallel=p, skip_bias_add=s, sequence_parallel=sp)
    for sp in (False, True)
    for p in ((True, False) if not sp else (True,))
    for s in (False, True)
]
_COLUMN_DEFAULTS = dict(gather_output=False, skip_bias_add=False, sequence_parallel=False, disable_grad_reduce=False)
_ROW_DEFAULTS = dict(input_is_parallel=True, skip_bias_add=False, sequence_parallel=False)


# --- the CPU shim ---------------------------------------------------------------------------------


class _CudaOnCpu:
    """``torch.cuda`` as the shimmed modules see it: ``current_device()`` is the CPU device."""

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """``torch`` with :class:`_CudaOnCpu` as ``cuda``; every other attribute is torch's own."""

    def __init__(self) -> None:
        super().__init__("torch", "torch, as Megatron's tensor-parallel modules see it under tpsim on a CPU machine")
        self.cuda = _CudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _install_cpu_shim(modules: list[types.ModuleType]) -> None:
    if torch.cuda.is_available():
        return  # a GPU machine runs Megatron's own code paths
    for module in modules:
        if not isinstance(getattr(module, "torch", None), _TorchOnCpu):
            module.torch = _TorchOnCpu()  # type: ignore[attr-defined]


def cpu_shim_installed() -> bool:
    """Whether Megatron's tensor-parallel modules currently see the CPU shim."""
    import sys

    return any(isinstance(getattr(sys.modules.get(m), "torch", None), _TorchOnCpu) for m in SHIMMED_MODULES)


# --- per rank ---------------------------------------------------------------------------------------


def _init_parallel_state(group: Any) -> None:
    """The parallel state Megatron's layers read, for this rank: its tp group and a fresh buffer."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps._TENSOR_MODEL_PARALLEL_GROUP = group
    ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = dist.get_process_group_ranks(group)
    ps.destroy_global_memory_buffer()
    ps._set_global_memory_buffer()


def _config(tp_size: int, sequence_parallel: bool, dtype: torch.dtype) -> Any:
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(
        tensor_model_parallel_size=tp_size,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        params_dtype=dtype,
    )


def _builder(cls: type, options: dict[str, Any]):
    sequence_parallel = options["sequence_parallel"]

    def build(in_features, out_features, bias, *, group, rank, world_size, master_weight, master_bias, dtype):
        _init_parallel_state(group)
        init = functools.partial(torch.nn.init.normal_, mean=0.0, std=_INIT_STD)
        config = _config(world_size, sequence_parallel, dtype)
        layer_options = {k: v for k, v in options.items() if k != "sequence_parallel"}
        return cls(in_features, out_features, config=config, init_method=init, bias=bias, tp_group=group,
                   **layer_options)

    return build


class MegatronPreset:
    """Megatron-core's ``ColumnParallelLinear`` and ``RowParallelLinear`` (see the module docstring)."""

    name = "megatron-core"
    requirement = "megatron-core==0.16.1"
    targets = ("megatron.core.tensor_parallel", _LAYERS)
    classes = {_COLUMN: "column", _ROW: "row"}
    rank_local = (_PARALLEL_STATE,)

    def load(self) -> dict[str, type]:
        layers = quiet_import(self, _LAYERS)
        quiet_import(self, _PARALLEL_STATE)
        import sys

        _install_cpu_shim([sys.modules[m] for m in SHIMMED_MODULES if m in sys.modules])
        route_rank_warnings()
        try:
            return {_COLUMN: layers.ColumnParallelLinear, _ROW: layers.RowParallelLinear}
        except AttributeError as err:  # a release that renamed them
            raise LibraryMissing(self, err) from err

    def variants(self, cls: type, kind: str) -> list[Variant]:
        self.load()
        # A subclass's own module too (a patch file may keep state of its own).
        own = () if cls.__module__.startswith("megatron.") else own_module_state(cls.__module__)
        rank_local = (*self.rank_local, *own)
        out = []
        if kind == "column":
            for opts in _COLUMN_OPTIONS:
                sp = opts["sequence_parallel"]
                out.append(Variant(
                    name=option_name(cls, list(opts.items()), _COLUMN_DEFAULTS),
                    kind="column",
                    build=_builder(cls, opts),
                    forward=add_returned_bias,
                    input="sequence-sharded" if sp else "replicated",
                    output="gathered" if opts["gather_output"] else "sharded",
                    # disable_grad_reduce: the replicated input's grad is left to the caller (LoRA adapters fuse it).
                    input_grad="partial" if opts["disable_grad_reduce"] else "complete",
                    params=(ParamSpec("weight", "weight", Shard(0)), ParamSpec("bias", "bias", Shard(0))),
                    description=f"{cls.__module__}.{cls.__qualname__} (Megatron-core preset)",
                    min_batch_dims=1,
                    max_batch_dims=2,
                    sequence_dim=0,
                    min_tp_size=2 if sp else 1,
                    rank_local=rank_local,
                ))
        else:
            for opts in _ROW_OPTIONS:
                sp = opts["sequence_parallel"]
                out.append(Variant(
                    name=option_name(cls, list(opts.items()), _ROW_DEFAULTS),
                    kind="row",
                    build=_builder(cls, opts),
                    forward=add_returned_bias,
                    input="sharded" if opts["input_is_parallel"] else "replicated",
                    output="sequence-sharded" if sp else "reduced",
                    # Under sequence parallelism the bias grad is a summand the trainer sums; the layer
                    # marks it bias.sequence_parallel = True, which tpsim reads as trainer-reduced.
                    params=(ParamSpec("weight", "weight", Shard(1)), ParamSpec("bias", "bias", Replicate())),
                    description=f"{cls.__module__}.{cls.__qualname__} (Megatron-core preset)",
                    min_batch_dims=1,
                    max_batch_dims=2,
                    sequence_dim=0,
                    min_tp_size=2 if sp else 1,
                    rank_local=rank_local,
                ))
        return out


PRESET = MegatronPreset()
