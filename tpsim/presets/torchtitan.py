"""The torchtitan preset: ``tpsim check torchtitan.models.llama3`` checks Llama 3's feed-forward,
attention and transformer block under torchtitan's own tensor-parallel sharding.

Tested with ``torchtitan==0.3.0``. torchtitan 0.3.0 parallelises a module with its own protocol:
each sub-config carries a ``sharding_config`` and ``Module.parallelize(parallel_dims)`` distributes
the parameters and wraps each forward with the redistributions. The preset builds each layer from its
config with the sharding ``set_llama3_sharding_config`` sets for every Llama 3 layer without sequence
parallelism, loads the masters and checks it as a plan target (:mod:`tpsim.props.module.plans`):

- ``FeedForward(w1, w2, w3)`` from the case's ``(hidden, ffn)``, ``set_dense_ffn_sharding``: ``w1``/``w3``
  colwise, ``w2`` rowwise;
- ``GQAttention`` (and a subclass of it, built the same way: ``tpsim check mypatch.py:MyAttention``) from
  ``(hidden, heads, kv_heads)`` as Llama 3 builds it (``make_gqa_config``: fused ``wqkv``,
  ``head_dim = hidden // heads``, ``ComplexRoPE`` with theta 500000 and llama scaling), with
  ``set_gqa_attention_sharding`` (``wqkv`` colwise, ``wo`` rowwise all-reduced, the input ``I -> R``)
  and ``set_gqa_inner_attention_local_map``. Heads and key/value heads are drawn as multiples of the tp
  size (the sharding splits whole key/value groups), ``head_dim`` 2 or 4. The inner attention is
  ``ScaledDotProductAttention`` (causal, no mask): Llama 3's own backends (flex, varlen) need compiled
  or CUDA kernels, and ``get_attention_config("sdpa")`` refuses language models; the tp question
  (whole heads per rank, the ``wo`` reduction) is the same. The forward is
  ``forward(x, None, None)``, positionally as ``Llama3TransformerBlock`` calls it (no masks, positions
  ``0..seq-1`` from the module's own rotary table, precomputed once by torchtitan in the constructor;
  a complex buffer, kept complex when the module is cast to the case's dtype). The module's own
  ``sharding_config`` is set as ``config.build()`` sets it, so its input grad is all-reduced
  (``input_grad="complete"``). Its complex rotary product is judged against the dense twin;
- ``Llama3TransformerBlock`` (and a subclass) from ``(hidden, ffn, heads, kv_heads)``: two ``RMSNorm``,
  that attention and a ``make_ffn_config`` feed-forward, sharded by ``set_llama3_sharding_config``'s
  per-layer step (``torchtitan.models.llama3.sharding._set_llama3_layer_sharding``, ``enable_sp=False``:
  the norms invariant, the attention and the feed-forward as above), called
  ``forward(x, None, None)``.

The context each gets, as the trainer gives it:

- ``ParallelDims(tp=world_size, every other degree 1)``, whose mesh is built over the **whole world**
  (``init_device_mesh``): the preset checks one tp group spanning the world (no subgroups);
- on a machine without CUDA, ``torchtitan.distributed.parallel_dims.device_type`` (torchtitan's
  module-level default ``"cuda"`` when no accelerator is found) is set to ``"cpu"`` before the mesh is
  built; with CUDA nothing is changed;
- the ``spmd_types`` backend (torchtitan's default) runs forward and backward inside
  ``torchtitan.distributed.utils.get_spmd_context(parallel_dims=...)``, as the trainer does. Outside
  it the module runs its local computation and **skips the collectives without an error** (a rank
  returns its own summand): the preset's ``FeedForward-spmd_types-no-context`` variant, checked by
  the tests, shows what tpsim reports then (``missing-reduction``);
- the ``partial_dtensor`` backend gives DTensor parameters (read in their placements);
- inputs ``[batch, seq, hidden]``: torchtitan's activation layouts name the sequence dim 1.

torchtitan imports ``triton`` at import time: without it, ``tpsim check torchtitan...`` is a usage
error naming the missing module. Not checked: sequence parallelism, the flex and varlen attention
backends.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpsim.errors import InvalidArgument
from tpsim.presets._base import quiet_import

__all__ = ["PRESET", "TorchtitanPreset", "BACKENDS"]

_FFN = "torchtitan.models.common.feed_forward.FeedForward"
_ATTN = "torchtitan.models.common.attention.GQAttention"
#: The Llama 3 model builds the common feed-forward and attention: the same classes, named under the
#: model's package so that ``tpsim check torchtitan.models.llama3`` lists them.
_LLAMA3_FFN = "torchtitan.models.llama3.FeedForward"
_LLAMA3_ATTN = "torchtitan.models.llama3.GQAttention"
_LLAMA3_BLOCK = "torchtitan.models.llama3.model.Llama3TransformerBlock"
#: Llama 3's rotary settings (``torchtitan.models.llama3``: ``ComplexRoPE``, theta 500000, llama
#: scaling), its table for positions ``0..ROPE_POSITIONS-1`` (the drawn sequences are shorter).
ROPE_THETA = 500000.0
ROPE_POSITIONS = 64
#: The spmd backends checked, and whether the forward runs inside ``get_spmd_context``.
BACKENDS = (("spmd_types", True),)


def _cpu_mesh_default() -> None:
    # torchtitan picks its mesh's device type at import ("cuda" when no accelerator is found); a CPU
    # machine builds CPU meshes. Every rank sets the same value.
    if not torch.cuda.is_available():
        import torchtitan.distributed.parallel_dims as parallel_dims

        parallel_dims.device_type = "cpu"


def _ffn_config(cls: type, hidden: int, ffn: int) -> Any:
    import spmd_types as spmd
    from torchtitan.models.common.decoder_sharding import dense_activation_placement, set_dense_ffn_sharding
    from torchtitan.models.common.linear import Linear

    config = cls.Config(w1=Linear.Config(in_features=hidden, out_features=ffn),
                        w2=Linear.Config(in_features=ffn, out_features=hidden),
                        w3=Linear.Config(in_features=hidden, out_features=ffn))
    # As set_llama3_sharding_config sets every layer without sequence parallelism.
    set_dense_ffn_sharding(config, attn_x_layout=dense_activation_placement(tp=spmd.I), enable_sp=False)
    return config


def _attention_config(cls: type, hidden: int, heads: int, kv_heads: int) -> Any:
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_gqa_config
    from torchtitan.models.common.decoder_sharding import (
        set_gqa_attention_sharding,
        set_gqa_inner_attention_local_map,
    )
    from torchtitan.models.common.rope import ComplexRoPE

    # As torchtitan.models.llama3 builds every layer's attention (fused wqkv, head_dim = dim // n_heads,
    # complex rotary tables), with the SDPA inner attention (causal, no mask) in place of flex/varlen,
    # which need compiled kernels.
    config = make_gqa_config(
        dim=hidden, n_heads=heads, n_kv_heads=kv_heads, wqkv_param_init={}, wo_param_init={},
        inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=True,
        rope=ComplexRoPE.Config(dim=hidden // heads, max_seq_len=ROPE_POSITIONS, theta=ROPE_THETA, scaling="llama"))
    # As set_llama3_sharding_config sets every layer without sequence parallelism.
    set_gqa_attention_sharding(config, enable_sp=False)
    set_gqa_inner_attention_local_map(config.inner_attention)
    return config


def _block_config(cls: type, hidden: int, ffn: int, heads: int, kv_heads: int) -> Any:
    from torchtitan.models.common.config_utils import make_ffn_config
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.llama3.sharding import _set_llama3_layer_sharding

    # As torchtitan.models.llama3's _build_llama3_layers builds every layer (its param inits aside: the
    # case's weights are loaded into the dense module before the plan shards it), with the attention of
    # _attention_config.
    attention = _attention_config(cls, hidden, heads, kv_heads)
    config = cls.Config(attention_norm=RMSNorm.Config(normalized_shape=hidden),
                        ffn_norm=RMSNorm.Config(normalized_shape=hidden), attention=attention,
                        feed_forward=make_ffn_config(dim=hidden, hidden_dim=ffn, w1_param_init={},
                                                     w2w3_param_init={}))
    # set_llama3_sharding_config's per-layer step (norms, attention, inner attention, feed-forward),
    # without sequence parallelism.
    _set_llama3_layer_sharding(config, enable_sp=False)
    return config


def _built(cls: type, config: Any, dtype: torch.dtype) -> nn.Module:
    """``cls(config)`` as ``config.build()`` makes it (its own sharding declared, for a subclass too), in
    ``dtype``. Rotary tables (complex buffers, which ``Module.to(float)`` would make real) are kept as
    torchtitan's precompute made them."""
    module = cls(config)
    if config.sharding_config is not None:
        module._sharding_config = config.sharding_config
    # Module.to's own conversion (parameters and buffers alike), for real floating tensors only.
    return module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)


class _Dense:
    """``cls`` (``role`` "ffn", "attention" or "block") built from its config with torchtitan's sharding declared
    (not yet applied)."""

    def __init__(self, cls: type, role: str = "ffn") -> None:
        self.cls, self.role = cls, role

    def __call__(self, *sizes: int, dtype: torch.dtype) -> nn.Module:
        if self.role == "ffn":
            return self.cls(_ffn_config(self.cls, *sizes)).to(dtype)
        config = (_attention_config if self.role == "attention" else _block_config)(self.cls, *sizes)
        return _built(self.cls, config, dtype)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Dense) and (other.cls, other.role) == (self.cls, self.role)

    def __hash__(self) -> int:
        return hash((self.cls, self.role))


class _Parallelize:
    """The plan: ``module.parallelize(ParallelDims(tp=world))`` on ``backend``; remembers the spmd
    context on the module when the forward needs it."""

    def __init__(self, backend: str, context: bool) -> None:
        self.backend, self.context = backend, context

    def __call__(self, module: nn.Module, mesh: Any) -> nn.Module:
        import torch.distributed as dist
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed.utils import get_spmd_context

        _cpu_mesh_default()
        ws = dist.get_world_size()
        if mesh.size() != ws:
            raise InvalidArgument(f"torchtitan builds its tp mesh over the whole world ({ws} ranks); the tp group has "
                                  f"{mesh.size()}")
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=ws, pp=1, ep=1, world_size=ws,
                            spmd_backend=self.backend)
        dims.build_mesh()
        module.parallelize(dims)
        if self.context:
            module._tpsim_spmd_context = get_spmd_context(parallel_dims=dims)
        return module

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Parallelize) and (other.backend, other.context) == (self.backend, self.context)

    def __hash__(self) -> int:
        return hash((self.backend, self.context))


class _SpmdRegion(torch.autograd.Function):
    """``module(x, *args)`` with its forward *and* its backward inside torchtitan's spmd context, as the
    trainer's ``train_context`` wraps both (the backward's collectives need it too): the module's own
    graph is built in the forward and back-propagated, in the context, in this node's backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, module: nn.Module, context: Any, args: tuple[Any, ...]) -> torch.Tensor:
        ctx.context = context
        ctx.x = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad(), context():
            ctx.y = module(ctx.x, *args)
        return ctx.y.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None, None]:
        with ctx.context():
            torch.autograd.backward(ctx.y, grad)
        return ctx.x.grad, None, None, None


def in_spmd_context(module: nn.Module, x: torch.Tensor, *args: Any) -> torch.Tensor:
    """``module(x, *args)``, forward and backward inside the spmd context its plan left on it (the dense
    reference has none)."""
    context = getattr(module, "_tpsim_spmd_context", None)
    return module(x, *args) if context is None else _SpmdRegion.apply(x, module, context, args)


def attention_in_spmd_context(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The attention's (or the block's) ``forward(x, attention_masks=None, positions=None)`` (SDPA:
    causal, no mask; positions ``0..seq-1`` from its own rotary table) in the spmd context
    (:func:`in_spmd_context`)."""
    return in_spmd_context(module, x, None, None)  # as Llama3TransformerBlock calls it: positionally


def clip_grad_norm(parameters: Any, max_norm: float) -> Any:
    """torchtitan's own clip by global norm (``torchtitan.distributed.utils.clip_grad_norm_``, what its
    trainer calls every step): part of each training step of its presets' checks."""
    from torchtitan.distributed.utils import clip_grad_norm_

    return clip_grad_norm_(parameters, max_norm)


def ffn_variant(cls: type, backend: str, context: bool) -> Any:
    """The variant of torchtitan's feed-forward ``cls`` under its tp sharding on ``backend`` (the forward
    inside the spmd context when ``context``)."""
    from tpsim.props.module.plans import plan_variant

    suffix = backend if context or backend != "spmd_types" else f"{backend}-no-context"
    return plan_variant(_Dense(cls), _Parallelize(backend, context), sizes=("hidden", "ffn"),
                        name=f"{cls.__qualname__}-{suffix}", plan_name=f"torchtitan set_dense_ffn_sharding, {backend}",
                        forward=in_spmd_context, input_grad="partial", min_batch_dims=2, subgroups=False,
                        clip=clip_grad_norm,
                        description=f"{cls.__module__}.{cls.__qualname__} under torchtitan's tp sharding ({backend})")


def _head_sizes(tp: int, divisible: bool) -> Any:
    """``(hidden, heads, kv_heads)``: key/value heads and heads multiples of the tp size (the sharding
    splits whole heads; the fused ``wqkv`` splits whole key/value groups), head_dim 2 or 4 (even: the
    complex rotary pairs features)."""
    from hypothesis import strategies as st

    def sizes(kv_per_rank: int, group: int, head_dim: int) -> tuple[int, int, int]:
        kv = tp * kv_per_rank
        return (kv * group * head_dim, kv * group, kv)

    return st.builds(sizes, st.integers(1, 2), st.integers(1, 2), st.sampled_from((2, 4)))


def _block_sizes(tp: int, divisible: bool) -> Any:
    """``(hidden, ffn, heads, kv_heads)``: the attention's sizes (:func:`_head_sizes`) and a feed-forward
    size a multiple of the tp size, at least 2 (torch's DTensor refuses a sharded dim of global size 1)."""
    from hypothesis import strategies as st

    def sizes(attention: tuple[int, int, int], ffn_per_rank: int) -> tuple[int, int, int, int]:
        hidden, heads, kv = attention
        return (hidden, tp * ffn_per_rank, heads, kv)

    return st.builds(sizes, _head_sizes(tp, divisible), st.integers(-(-2 // tp), 3))


def block_variant(cls: type, backend: str, context: bool) -> Any:
    """The variant of torchtitan's Llama 3 transformer block ``cls`` (``Llama3TransformerBlock`` or a
    subclass) under its tp sharding on ``backend`` (the forward inside the spmd context when
    ``context``)."""
    from tpsim.props.module.plans import plan_variant

    suffix = backend if context or backend != "spmd_types" else f"{backend}-no-context"
    return plan_variant(_Dense(cls, "block"), _Parallelize(backend, context),
                        sizes=("hidden", "ffn", "heads", "kv_heads"), name=f"{cls.__qualname__}-{suffix}",
                        plan_name=f"torchtitan set_llama3_sharding_config (one layer), {backend}",
                        forward=attention_in_spmd_context, size_strategy=_block_sizes, min_batch_dims=2,
                        max_batch_dims=2, subgroups=False, clip=clip_grad_norm,
                        description=f"{cls.__module__}.{cls.__qualname__} (RMSNorms, Llama 3 attention with SDPA "
                                    f"causal, SwiGLU feed-forward) under torchtitan's tp sharding ({backend})")


def attention_variant(cls: type, backend: str, context: bool) -> Any:
    """The variant of torchtitan's Llama 3 attention ``cls`` (``GQAttention`` or a subclass) under its tp
    sharding on ``backend`` (the forward inside the spmd context when ``context``)."""
    from tpsim.props.module.plans import plan_variant

    suffix = backend if context or backend != "spmd_types" else f"{backend}-no-context"
    return plan_variant(_Dense(cls, "attention"), _Parallelize(backend, context), sizes=("hidden", "heads", "kv_heads"),
                        name=f"{cls.__qualname__}-{suffix}",
                        plan_name=f"torchtitan set_gqa_attention_sharding, {backend}",
                        forward=attention_in_spmd_context, size_strategy=_head_sizes, min_batch_dims=2,
                        max_batch_dims=2, subgroups=False, clip=clip_grad_norm,
                        description=f"{cls.__module__}.{cls.__qualname__} (Llama 3: fused wqkv, complex rotary, "
                                    f"SDPA causal) under torchtitan's tp sharding ({backend})")


class TorchtitanPreset:
    """torchtitan 0.3.0's dense feed-forward, Llama 3 attention and transformer block under their tp
    sharding (see the module docstring)."""

    name = "torchtitan"
    requirement = "torchtitan==0.3.0"
    targets = ("torchtitan.models.llama3", "torchtitan.models.common", "torchtitan.models.common.feed_forward",
               "torchtitan.models.common.attention")
    classes = {_FFN: "module", _LLAMA3_FFN: "module", _ATTN: "module", _LLAMA3_ATTN: "module",
               _LLAMA3_BLOCK: "module"}
    rank_local: tuple[str, ...] = ()

    def load(self) -> dict[str, Any]:
        try:
            ffn = quiet_import(self, "torchtitan.models.common.feed_forward").FeedForward
            attention = quiet_import(self, "torchtitan.models.common.attention").GQAttention
            block = quiet_import(self, "torchtitan.models.llama3.model").Llama3TransformerBlock
        except InvalidArgument as err:
            if "triton" in str(err):
                raise InvalidArgument(f"{err}; torchtitan 0.3.0 imports triton at import time: pip install -c "
                                      "constraints.txt triton") from None
            raise
        return {_FFN: ffn, _LLAMA3_FFN: ffn, _ATTN: attention, _LLAMA3_ATTN: attention, _LLAMA3_BLOCK: block}

    def variants(self, cls: Any, kind: str) -> list[Any]:
        from torchtitan.models.common.attention import GQAttention
        from torchtitan.models.llama3.model import Llama3TransformerBlock

        make = (attention_variant if issubclass(cls, GQAttention) else
                block_variant if issubclass(cls, Llama3TransformerBlock) else ffn_variant)
        return [make(cls, backend, context) for backend, context in BACKENDS]


#: The preset object (listed in :data:`tpsim.presets.PRESETS`).
PRESET = TorchtitanPreset()
