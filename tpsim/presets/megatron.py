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
- constructs the layer with its own init, then loads the case's full weights as a Megatron
  checkpoint is loaded: the layer's own ``sharded_state_dict()`` places each tensor in the full one
  (its ``global_offset``), and that slice is copied in (:func:`load_sharded`): Megatron's slicing, never
  tpsim's; the declared layouts, weight ``[out/tp, in]`` (column) / ``[out, in/tp]`` (row), are only
  how the pieces are read back and judged right after construction;
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
from tpsim.vocab_variant import CROSS_ENTROPY_KIND, EMBEDDING_KIND, CrossEntropyVariant, EmbeddingVariant

__all__ = ["PRESET", "MegatronPreset", "cpu_shim_installed", "megatron_label_smoothing"]

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
_EMBEDDING = f"{_LAYERS}.VocabParallelEmbedding"
_CROSS_ENTROPY_MODULE = "megatron.core.tensor_parallel.cross_entropy"
_CROSS_ENTROPY = f"{_CROSS_ENTROPY_MODULE}.vocab_parallel_cross_entropy"
#: The autograd function ``vocab_parallel_cross_entropy`` applies: a patch subclasses it.
_CROSS_ENTROPY_FUNCTION = f"{_CROSS_ENTROPY_MODULE}._VocabParallelCrossEntropy"
_PARALLEL_STATE = "megatron.core.parallel_state"
#: Megatron's default ``init_method_std``; the case's weights are loaded over the layer's own init.
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
#: Embedding options: the forward's (reduce_scatter_embeddings, a constructor argument, and the config's
#: deterministic_mode: indexing instead of F.embedding) in every combination; the config's init flags,
#: read by the constructor only, with the default forward. use_cpu_initialization=False draws the
#: weight on the GPU (through the CPU shim here); with perform_initialization=True it also needs
#: Megatron's CUDA RNG tracker, so it is left out.
_EMBEDDING_DEFAULTS = dict(reduce_scatter_embeddings=False, deterministic_mode=False, use_cpu_initialization=True,
                           perform_initialization=True)
_EMBEDDING_OPTIONS = [
    dict(_EMBEDDING_DEFAULTS, **changed)
    for changed in (
        *(dict(reduce_scatter_embeddings=r, deterministic_mode=d) for r in (False, True) for d in (False, True)),
        dict(perform_initialization=False),
        dict(use_cpu_initialization=False, perform_initialization=False),
    )
]
#: Embedding options that are constructor arguments (the others are config fields).
_EMBEDDING_LAYER_OPTIONS = ("reduce_scatter_embeddings",)
#: vocab_parallel_cross_entropy computes in float32 (``.float()``) whatever the logits' dtype.
_CROSS_ENTROPY_DTYPES = ("float32", "bfloat16", "float16")


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


def init_parallel_state(group: Any) -> None:
    """The parallel state Megatron's layers read, for this rank: its tp group and a fresh buffer."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps._TENSOR_MODEL_PARALLEL_GROUP = group
    ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = dist.get_process_group_ranks(group)
    ps.destroy_global_memory_buffer()
    ps._set_global_memory_buffer()


def megatron_config(tp_size: int, dtype: torch.dtype, **options: Any) -> Any:
    """The ``ModelParallelConfig`` of one build (see the module docstring); ``options`` are config
    fields a variant sets (``sequence_parallel``, ``deterministic_mode``, the init flags)."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    fields: dict[str, Any] = dict(use_cpu_initialization=True, perform_initialization=True)
    fields.update(options)
    return ModelParallelConfig(tensor_model_parallel_size=tp_size, gradient_accumulation_fusion=False,
                               params_dtype=dtype, **fields)


def init_method() -> Any:
    """Megatron's default init (normal, std ``init_method_std``); the case's weights are loaded over it."""
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=_INIT_STD)


def load_sharded(module: Any, masters: dict[str, torch.Tensor | None]) -> None:
    """Load the full ``masters`` into ``module`` as a Megatron checkpoint is loaded: the layer's own
    ``sharded_state_dict()`` says where each of its tensors sits in the full one (``global_offset``,
    its local shape), and that slice of the master is copied in. Megatron's slicing, as its
    ``dist_checkpointing`` uses it; tpsim cuts nothing itself."""
    # No data-parallel group: every tensor is this rank's only replica (replica ids are not read here).
    sharded = module.sharded_state_dict(prefix="", metadata={"dp_cp_group": None})
    with torch.no_grad():
        for key, master in masters.items():
            entry = sharded.get(key)
            if master is None or entry is None or getattr(entry, "data", None) is None:
                continue
            if tuple(entry.global_shape) != tuple(master.shape):
                raise RuntimeError(f"Megatron's sharded_state_dict says {key} is a piece of a tensor of shape "
                                   f"{list(entry.global_shape)}; the dense {key} has shape {list(master.shape)}")
            index = tuple(slice(o, o + n) for o, n in zip(entry.global_offset, entry.data.shape, strict=True))
            entry.data.copy_(master[index])


def _builder(cls: type, options: dict[str, Any]):
    sequence_parallel = options["sequence_parallel"]

    def build(in_features, out_features, bias, *, group, rank, world_size, master_weight, master_bias, dtype):
        init_parallel_state(group)
        config = megatron_config(world_size, dtype, sequence_parallel=sequence_parallel)
        layer_options = {k: v for k, v in options.items() if k != "sequence_parallel"}
        layer = cls(in_features, out_features, config=config, init_method=init_method(), bias=bias, tp_group=group,
                    **layer_options)
        load_sharded(layer, {"weight": master_weight, "bias": master_bias})
        return layer

    return build


class MegatronPreset:
    """Megatron-core's ``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding`` and
    ``vocab_parallel_cross_entropy`` (see the module docstring)."""

    name = "megatron-core"
    requirement = "megatron-core==0.16.1"
    targets = ("megatron.core.tensor_parallel", _LAYERS)
    classes = {_COLUMN: "column", _ROW: "row", _EMBEDDING: EMBEDDING_KIND, _CROSS_ENTROPY: CROSS_ENTROPY_KIND,
               _CROSS_ENTROPY_FUNCTION: CROSS_ENTROPY_KIND}
    rank_local = (_PARALLEL_STATE,)

    def load(self) -> dict[str, Any]:
        layers = quiet_import(self, _LAYERS)
        cross_entropy = quiet_import(self, _CROSS_ENTROPY_MODULE)
        quiet_import(self, _PARALLEL_STATE)
        import sys

        _install_cpu_shim([sys.modules[m] for m in SHIMMED_MODULES if m in sys.modules])
        route_rank_warnings()
        try:
            # What `tpsim check megatron.core.tensor_parallel` checks: the public function, not the
            # autograd function it applies (whose subclasses get the preset all the same).
            return {_COLUMN: layers.ColumnParallelLinear, _ROW: layers.RowParallelLinear,
                    _EMBEDDING: layers.VocabParallelEmbedding, _CROSS_ENTROPY: cross_entropy.vocab_parallel_cross_entropy}
        except AttributeError as err:  # a release that renamed them
            raise LibraryMissing(self, err) from err

    def variants(self, cls: Any, kind: str) -> list[Any]:
        self.load()
        # A subclass's own module too (a patch file may keep state of its own).
        own = () if cls.__module__.startswith("megatron.") else own_module_state(cls.__module__)
        rank_local = (*self.rank_local, *own)
        description = f"{cls.__module__}.{cls.__qualname__} (Megatron-core preset)"
        if kind == EMBEDDING_KIND:
            return _embedding_variants(cls, rank_local, description)
        if kind == CROSS_ENTROPY_KIND:
            return _cross_entropy_variants(cls, rank_local, description)
        return _linear_variants(cls, kind, rank_local, description)


def _linear_variants(cls: type, kind: str, rank_local: tuple[str, ...], description: str) -> list[Variant]:
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
                params=(ParamSpec("weight", "weight", Shard(0), load=False),
                        ParamSpec("bias", "bias", Shard(0), load=False)),
                description=description,
                min_batch_dims=1,
                max_batch_dims=2,
                sequence_dim=0,
                min_tp_size=2 if sp else 1,
                # Under sequence parallelism the forward all-gathers its input as the caller gave it
                # (LinearWithGradAccumulationAndAsyncCommunication.forward: all_gather_into_tensor on
                # `input`, no .contiguous(); megatron-core 0.16.1 layers.py:483), which NCCL refuses for a
                # non-contiguous tensor; its documented input is the [sequence, batch, hidden] activation
                # its callers produce contiguous (ColumnParallelLinear.forward's docstring): a precondition.
                contiguous_inputs=sp,
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
                params=(ParamSpec("weight", "weight", Shard(1), load=False),
                        ParamSpec("bias", "bias", Replicate(), load=False)),
                description=description,
                min_batch_dims=1,
                max_batch_dims=2,
                sequence_dim=0,
                min_tp_size=2 if sp else 1,
                rank_local=rank_local,
            ))
    return out


# --- the vocab-parallel embedding -------------------------------------------------------------------


def _embedding_builder(cls: type, options: dict[str, Any]):
    layer_options = {k: v for k, v in options.items() if k in _EMBEDDING_LAYER_OPTIONS}
    config_options = {k: v for k, v in options.items() if k not in _EMBEDDING_LAYER_OPTIONS}

    def build(num_embeddings: int, embedding_dim: int, *, group: Any, dtype: torch.dtype, weight: torch.Tensor) -> Any:
        import torch.distributed as dist

        init_parallel_state(group)
        config = megatron_config(dist.get_world_size(group), dtype, **config_options)
        layer = cls(num_embeddings, embedding_dim, init_method=init_method(), config=config, tp_group=group,
                    **layer_options)
        load_sharded(layer, {"weight": weight})  # its vocabulary rows, where its checkpoint metadata places them
        return layer

    return build


def _gathered_sequence(module: Any, ids: torch.Tensor) -> torch.Tensor:
    """The embedding under ``reduce_scatter_embeddings``, as the replicated lookup of ``ids [b, s]``.

    The layer returns this rank's slice of the sequence, sequence first: ``[s/tp, b, h]``. It is
    all-gathered in rank order (so each rank's slice must be the right one) and put back as
    ``[b, s, h]``; the gather's backward hands each rank its slice of the (replicated) upstream grad,
    which the layer's reduce-scatter backward all-gathers again."""
    from tpsim.layers import gather_from_tensor_parallel_region

    out = module(ids)  # [s/tp, b, h]
    full = gather_from_tensor_parallel_region(out.permute(1, 2, 0), module.tp_group)  # [b, h, s]
    return full.permute(0, 2, 1)


def _embedding_variants(cls: type, rank_local: tuple[str, ...], description: str) -> list[EmbeddingVariant]:
    out = []
    for opts in _EMBEDDING_OPTIONS:
        name = option_name(cls, list(opts.items()), _EMBEDDING_DEFAULTS)
        scatters = opts["reduce_scatter_embeddings"]
        out.append(EmbeddingVariant(
            name=name,
            build=_embedding_builder(cls, opts),
            load=False,  # Megatron's checkpoint metadata places this rank's rows (load_sharded)
            forward=_gathered_sequence if scatters else None,
            description=description,
            # The layer takes ids [b, s] (its docstring and GPTModel's); one dim or two are checked. A 0-dim
            # id is outside that contract, and deterministic_mode cannot take one: self.weight[ids] with a
            # 0-dim index is basic indexing, a view of the weight, which the masking then writes in place.
            # reduce_scatter_embeddings transposes [b, s] ids to a sequence-first output and scatters the
            # sequence: ids of two dims whose second divides by the tp size.
            min_batch_dims=2 if scatters else 1,
            max_batch_dims=2,
            sequence_dim=1 if scatters else None,
            notes=(f"{name} declares ids [b, s] with s divisible by the tp size only (its output is the "
                   "sequence-first [s/tp, b, h], gathered back to compare)",) if scatters else
                  (f"{name} declares ids of 1 or 2 dims only ([b, s]: a 0-dim id is outside its contract)",),
            rank_local=rank_local,
        ))
    return out


# --- the vocab-parallel cross-entropy -----------------------------------------------------------------


def megatron_label_smoothing(label_smoothing: float, vocab_size: int) -> float:
    """Megatron's ``label_smoothing`` for ``F.cross_entropy``'s ``label_smoothing`` over ``vocab_size`` ids.

    ``F.cross_entropy`` gives the target ``1 - eps + eps/V`` and every other id ``eps/V``; Megatron
    gives the target ``1 - s`` and every other id ``s/(V-1)`` (its docstring: the mass goes to the
    ``V - 1`` ids that are not the target). They are the same distribution when ``s = eps (V-1)/V``
    (docs/presets.md has the derivation); ``s < 1`` for every ``eps`` in [0, 1], as Megatron requires."""
    return label_smoothing * (vocab_size - 1) / vocab_size


def _cross_entropy_fn(apply: Any):
    """``apply(logits, target, megatron_label_smoothing)`` as a tpsim cross-entropy: this rank's parallel
    state set first (Megatron reads the tp group from it), the loss in the logits' dtype."""

    def fn(logits: torch.Tensor, target: torch.Tensor, *, group: Any, label_smoothing: float = 0.0) -> torch.Tensor:
        import torch.distributed as dist

        init_parallel_state(group)
        vocab_size = logits.shape[-1] * dist.get_world_size(group)  # equal shards: vocabularies that divide
        loss = apply(logits, target, megatron_label_smoothing(label_smoothing, vocab_size))
        # Megatron computes the loss in float32 whatever the logits' dtype and returns it so; compared in
        # the logits' dtype (one rounding, within that dtype's bound).
        return loss.to(logits.dtype)

    return fn


def _cross_entropy_variants(obj: Any, rank_local: tuple[str, ...], description: str) -> list[CrossEntropyVariant]:
    # The library's function, or a subclass of the autograd function it applies (a patch).
    apply = obj.apply if isinstance(obj, type) else obj
    name = obj.__qualname__
    return [
        CrossEntropyVariant(
            name=name if smoothing else f"{name}(label_smoothing=0)",
            fn=_cross_entropy_fn(apply),
            accepts=("label_smoothing", "group") if smoothing else ("group",),
            dtypes=_CROSS_ENTROPY_DTYPES,
            description=description,
            notes=() if smoothing else (f"label smoothing is checked by the variant {name}",),
            rank_local=rank_local,
        )
        for smoothing in (False, True)
    ]


PRESET = MegatronPreset()
