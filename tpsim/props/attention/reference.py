"""The dense reference of an attention case and its tolerances: tpsim's own dense attention and its twin.

The reference is :class:`tpsim.layers.DenseAttention` (tpsim's code, so the process that judges runs
it itself) loaded with the case's master parameters, forward and backward in float64 on the tp
group's input and upstream grad. The tolerances come from the dense twin, as for a whole module
(:mod:`tpsim.props.module.twin`): the same dense attention run in the case's precision (float32 for
a float64 case) measures how much rounding this very computation amplifies — through the scores, the
softmax and the out-projection — and every compared tensor is allowed that (``twin_bound``), in
every dtype, with no rule per operation.

The recognisers of :mod:`tpsim.props.attention.checks` ask for the attention a buggy block computes
(``scale``: another softmax scale; ``kv_map``: another pairing of query heads with key/value heads)
as positive evidence: the same dense attention, with the key/value heads expanded to one per query
head as ``kv_map`` pairs them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tpsim.layers.attention import DenseAttention
from tpsim.props.attention.case import AttentionCase
from tpsim.props.module.twin import relative_error, resolved, twin_bound, twin_dtype
from tpsim.props.tolerance import Tolerance

__all__ = ["attention_run", "attention_reference"]

_F64 = torch.float64


def _dense(case: AttentionCase, masters: dict[str, torch.Tensor | None], dtype: torch.dtype,
           scale: float | None, kv_map: Sequence[int] | None) -> DenseAttention:
    h, g, d = case.num_heads, case.num_kv_heads, case.head_dim
    weight, bias = masters["qkv.weight"], masters["qkv.bias"]
    if kv_map is not None:  # one key/value head per query head, as kv_map pairs them
        idx = [i * d + r for i in range(h) for r in range(d)]
        k_rows = [(h + j) * d + r for j in kv_map for r in range(d)]
        v_rows = [(h + g + j) * d + r for j in kv_map for r in range(d)]
        rows = torch.tensor(idx + k_rows + v_rows)
        weight = weight.index_select(0, rows)  # type: ignore[union-attr]
        bias = None if bias is None else bias.index_select(0, rows)
        g = h
    dense = DenseAttention(case.hidden, h, g, head_dim=d, bias=bias is not None, causal=case.causal,
                           softmax_scale=scale, dtype=dtype)
    with torch.no_grad():
        for param, value in ((dense.qkv.weight, weight), (dense.qkv.bias, bias), (dense.proj.weight, masters["proj.weight"]),
                             (dense.proj.bias, masters["proj.bias"])):
            if param is not None and value is not None:
                param.copy_(value)
    return dense


def attention_run(case: AttentionCase, masters: dict[str, torch.Tensor | None], x: torch.Tensor, gy: torch.Tensor,
                  dtype: torch.dtype = _F64, *, scale: float | None = None,
                  kv_map: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """The dense attention's output ``y``, input grad ``x`` and parameter grads (by name) in ``dtype``;
    ``scale``/``kv_map``: the attention a buggy block computes instead (see the module docstring)."""
    dense = _dense(case, masters, dtype, scale, kv_map)
    xs = x.to(dtype, copy=True).requires_grad_()
    y = dense(xs)
    y.backward(gy.to(dtype))
    out = {"y": y.detach(), "x": xs.grad}
    out.update({name: p.grad for name, p in dense.named_parameters() if p.grad is not None})
    return out


def attention_reference(case: AttentionCase, masters: dict[str, torch.Tensor | None], x: torch.Tensor,
                        gy: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{name: (float64 value, tolerance)}`` of the output, the input grad and every parameter grad of a
    tp group's data: the bound of each tensor is the twin's (:func:`tpsim.props.module.twin.twin_bound`,
    the twin's worst relative error pooled over the tensors), as a tolerance tensor of its shape."""
    tp = case.tp_size or case.world_size
    ref = attention_run(case, masters, x, gy, _F64)
    twin = attention_run(case, masters, x, gy, twin_dtype(case.torch_dtype))
    rho = max((relative_error(ref[n], twin.get(n)) for n in ref if resolved(ref[n], twin.get(n))), default=0.0)
    out = {}
    for name, value in ref.items():
        low = twin.get(name)
        own = float((low.to(_F64) - value).abs().max()) if low is not None and value.numel() else 0.0
        bound = twin_bound(value, rho, case.torch_dtype, tp, own)
        # The floor of the one tolerance model (a zero reference is no demand of exactness).
        floor = Tolerance(case.torch_dtype, tp).bound(torch.zeros((), dtype=_F64), 1)
        out[name] = (value.to(_F64), torch.full_like(value, bound, dtype=_F64).clamp_min(floor))
    return out
