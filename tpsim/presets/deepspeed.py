"""The DeepSpeed preset: ``tpsim check deepspeed.module_inject.layers`` and subclasses of its AutoTP layers.

Tested with ``deepspeed==0.19.8``. AutoTP replaces a model's ``nn.Linear`` layers by
``LinearLayer(module, mp_group, gather_output=False)`` (column parallel: it slices the dense layer's
weight and bias along the output features itself), ``LinearAllreduce(module, mp_group)`` (row
parallel: it slices the weight along the input features and keeps the whole bias, added after its
all-reduce) and ``LinearAllreduceWithReplicatedInput`` (a row layer that takes the full input and
slices it itself). For each rank the preset

- sets AutoTP's training mode (``set_autotp_mode(training=True)``: the weights keep
  ``requires_grad`` and the bias is added out of place) and creates DeepSpeed's communication
  backend over the process group tpsim set up (``deepspeed.comm.init_distributed``; with
  ``torch.distributed`` already initialised it only wraps it);
- builds a dense ``nn.Linear`` holding the master weight and bias and hands it to the layer with
  the tp group, so the layer's **own slicing** is what is checked: the parameters are declared
  ``load=False`` and tpsim compares the slices the layer kept with the master's
  (:func:`tpsim.variant.load_master` checks them, it does not overwrite them).

Inference mode (AutoTP's default: ``requires_grad=False``, the bias added in place, the all-reduce
through ``inference_all_reduce``) is checked forward-only (``forward_only=True``).

AutoTP splits a size that does not divide by the tp size unevenly, by design (the first
``size % tp`` ranks hold one more row or column, ``torch.tensor_split``'s pieces), and computes the
right result: tpsim infers that layout from the shards' shapes and checks the result against the
dense layer (see "Uneven by design" in docs/presets.md).

``deepspeed.comm.comm`` (its backend object) and ``deepspeed.module_inject.layers`` (the AutoTP
mode) keep per-process globals: both are rank-local on inproc. The layers take the group as an
argument, so tp groups smaller than the world, consecutive or strided, are checked. Inputs may have
any number of batch dims.

A dense module under DeepSpeed's automatic tensor parallelism is a plan target:
``tpsim check MODULE:DenseClass --plan tpsim.presets.deepspeed:autotp`` (:func:`autotp`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpsim.conventions import own_module_state
from tpsim.errors import InvalidArgument
from tpsim.placement import Replicate, Shard
from tpsim.presets._base import LibraryMissing, option_name, quiet_import, route_rank_warnings
from tpsim.variant import ParamSpec, Variant

__all__ = ["PRESET", "DeepSpeedPreset", "autotp"]

_LAYERS = "deepspeed.module_inject.layers"
_COMM = "deepspeed.comm.comm"
_GROUPS = "deepspeed.utils.groups"
_COLUMN = f"{_LAYERS}.LinearLayer"
_ROW = f"{_LAYERS}.LinearAllreduce"
_ROW_REPLICATED = f"{_LAYERS}.LinearAllreduceWithReplicatedInput"
_COLUMN_DEFAULTS = {"gather_output": False, "training": True}
_ROW_DEFAULTS = {"training": True}
_MODES = (True, False)


def _init_deepspeed(training: bool) -> None:
    import deepspeed.comm as ds_comm
    from deepspeed.module_inject import layers

    layers.set_autotp_mode(training=training)
    if not ds_comm.is_initialized():
        _no_shm_op()
        # torch.distributed is initialised (by tpsim, on every backend): DeepSpeed only wraps it.
        ds_comm.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False,
                                 verbose=False)


def _no_shm_op() -> None:
    """Keep DeepSpeed's communication backend from JIT-compiling its shared-memory all-reduce kernel.

    On a CPU machine ``TorchBackend()`` compiles ``deepspeed_shm_comm`` with the C++ toolchain the
    first time (minutes; a lock file left by an interrupted build blocks every later one), when the
    op's entry in ``deepspeed.ops.__compatible_ops__`` says it can. The op is only a faster
    ``inference_all_reduce`` on one node; without it DeepSpeed falls back to
    ``torch.distributed.all_reduce`` (the path it takes on a GPU). The entry is set before
    DeepSpeed probes the toolchain (the probe runs compilers too); an existing probe result is kept,
    with the op marked unavailable.
    """
    import deepspeed.ops as ops

    compatible = ops.__dict__.setdefault("__compatible_ops__", {})
    compatible["deepspeed_shm_comm"] = False


def _builder(cls: type, options: dict[str, Any], training: bool):
    def build(in_features, out_features, bias, *, group, rank, world_size, master_weight, master_bias, dtype):
        _init_deepspeed(training)
        dense = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
        with torch.no_grad():
            dense.weight.copy_(master_weight)
            if bias:
                dense.bias.copy_(master_bias)
        return cls(dense, group, **options)

    return build


def _params(kind: str) -> tuple[ParamSpec, ...]:
    # load=False: the layer slices the dense layer it was given; tpsim checks those slices.
    if kind == "column":
        return (ParamSpec("weight", "weight", Shard(0), load=False), ParamSpec("bias", "bias", Shard(0), load=False))
    return (ParamSpec("weight", "weight", Shard(1), load=False), ParamSpec("bias", "bias", Replicate(), load=False))


class DeepSpeedPreset:
    """DeepSpeed AutoTP's ``LinearLayer``, ``LinearAllreduce`` and ``LinearAllreduceWithReplicatedInput``."""

    name = "deepspeed"
    requirement = "deepspeed==0.19.8"
    targets = ("deepspeed.module_inject", _LAYERS)
    classes = {_COLUMN: "column", _ROW: "row", _ROW_REPLICATED: "row"}
    rank_local = (_COMM, _LAYERS)

    def load(self) -> dict[str, type]:
        layers = quiet_import(self, _LAYERS)
        quiet_import(self, _COMM)
        route_rank_warnings()
        try:
            return {_COLUMN: layers.LinearLayer, _ROW: layers.LinearAllreduce,
                    _ROW_REPLICATED: layers.LinearAllreduceWithReplicatedInput}
        except AttributeError as err:
            raise LibraryMissing(self, err) from err

    def variants(self, cls: type, kind: str) -> list[Variant]:
        layers = self.load()
        own = () if cls.__module__.startswith("deepspeed.") else own_module_state(cls.__module__)
        rank_local = (*self.rank_local, *own)
        description = f"{cls.__module__}.{cls.__qualname__} (deepspeed preset)"
        common = dict(description=description, rank_local=rank_local, params=_params(kind))
        if kind == "column":
            return [
                Variant(
                    name=option_name(cls, [("gather_output", g), ("training", t)], _COLUMN_DEFAULTS),
                    kind="column",
                    build=_builder(cls, {"gather_output": g}, t),
                    input="replicated",
                    output="gathered" if g else "sharded",
                    **_mode(t),
                    **common,
                )
                for t in _MODES
                for g in (False, True)
            ]
        replicated_input = issubclass(cls, layers[_ROW_REPLICATED])
        return [
            Variant(
                name=option_name(cls, [("training", t)], _ROW_DEFAULTS),
                kind="row",
                build=_builder(cls, {}, t),
                input="replicated" if replicated_input else "sharded",
                output="reduced",
                **_mode(t),
                **common,
            )
            for t in _MODES
        ]


def _mode(training: bool) -> dict[str, Any]:
    return {} if training else {"forward_only": True}


PRESET = DeepSpeedPreset()


# --- AutoTP on a whole dense module: a plan (tpsim.props.module.plans) --------------------------------


class _AutoTPModel(nn.Module):
    """The model AutoTP's parser is given: the checked module as the one repeated layer of its
    ``layers`` ``ModuleList`` (where the parser looks for a model's transformer layers; the class
    name ends in ``Model``, as the parser requires of a model)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([layer])


class _Engine:
    """What ``DeepSpeedEngine._apply_autotp_partitioning`` reads of its engine: the AutoTP size (the
    tp group's), no local device to select (CPU) and no DeepCompile."""

    local_rank = -1

    def __init__(self, tp_size: int) -> None:
        self._tp_size = tp_size

    def autotp_size(self) -> int:
        return self._tp_size

    def is_deepcompile_enabled(self) -> bool:
        return False

    def compile_autotp(self) -> bool:
        return False


def autotp(module: nn.Module, mesh: Any) -> nn.Module:
    """``module`` sharded by DeepSpeed's automatic tensor parallelism for training over ``mesh``'s group:
    a plan (``--plan tpsim.presets.deepspeed:autotp``).

    What ``deepspeed.initialize`` does with ``"tensor_parallel": {"autotp_size": tp}`` (or after
    ``deepspeed.tp_model_init(model, tp, dtype)``), by DeepSpeed's own code: AutoTP's training mode
    (``set_autotp_mode(training=True)``), the tp group in ``deepspeed.utils.groups`` (where
    ``deepspeed.initialize`` puts the one it creates: here the case's group, so tp groups smaller than
    the world are checked), then ``DeepSpeedEngine._apply_autotp_partitioning`` on a model holding
    ``module`` as its one transformer layer. AutoTP's policy decides each ``nn.Linear``: row parallel
    (``LinearAllreduce``) when its name has ``down_proj``, ``o_proj`` or ``out_proj`` or a LayerNorm
    follows it, column parallel (``LinearLayer``) otherwise. A module AutoTP finds nothing to shard
    in is refused (it would pass as the dense module it stays). A model's Hugging Face ``tp_plan``
    (which DeepSpeed prefers when the model carries one) is not applied: the plan is AutoTP's own.
    """
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.utils import groups

    _init_deepspeed(training=True)
    from deepspeed.module_inject.layers import TensorParallel_Layer, configure_tensor_parallel_runtime

    group, tp_size = mesh.get_group(), mesh.size()
    groups._TENSOR_MODEL_PARALLEL_GROUP = group
    groups._MODEL_PARALLEL_GROUP = group
    dtype = next((p.dtype for p in module.parameters()), torch.get_default_dtype())
    config = TPTrainingConfig(autotp_size=tp_size, dtype=dtype)
    configure_tensor_parallel_runtime(config)
    model = _AutoTPModel(module)
    try:
        DeepSpeedEngine._apply_autotp_partitioning(_Engine(tp_size), model, config)
    except AssertionError as err:  # AutoTP's parser states what it cannot shard with asserts
        raise InvalidArgument(f"DeepSpeed AutoTP cannot shard {type(module).__name__}: {err} (AutoTP makes an "
                              "nn.Linear row parallel when its name has down_proj, o_proj or out_proj or a "
                              "LayerNorm follows it; a module with none of them has no policy)") from None
    sharded = model.layers[0]
    if tp_size > 1 and not any(isinstance(m, TensorParallel_Layer) for m in sharded.modules()):
        raise InvalidArgument(f"DeepSpeed AutoTP sharded no layer of {type(module).__name__} over {tp_size} ranks; "
                              "expected a module with nn.Linear layers for AutoTP to replace")
    return sharded


#: Per process in a real job: DeepSpeed's communication backend, AutoTP's mode, the tp group.
autotp.rank_local = (_COMM, _LAYERS, _GROUPS)  # type: ignore[attr-defined]
#: AutoTP splits a size that does not divide into torch.tensor_split's pieces: ordinary cases, exact.
autotp.uneven_sizes_are_cases = True  # type: ignore[attr-defined]
