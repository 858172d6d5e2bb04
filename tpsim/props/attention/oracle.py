"""Float64 self-attention, written out, with a first-order bound on the rounding error of every value.

This is the dense reference of the attention family and its tolerances. The attention is explicit
tensor algebra (not ``scaled_dot_product_attention``, not :class:`tpsim.layers.DenseAttention`),
forward and backward, and next to every value it carries a bound on the error the sharded block's
own arithmetic may add in the case's dtype (``u = eps(dtype)``, ``g(K) = C u sqrt(K + 2)``: the
probabilistic rounding bound of :mod:`tpsim.props.tolerance`, with its factor ``C = 4``):

- a product ``C = A B`` of length ``K`` (a dot product, then up to ``ws`` partial sums and a bias
  add): ``eC = sqrt(eA² B² + A² eB²) + g(K) |A| |B|`` — the operands' errors carried through, as
  independent errors add (root-sum-square), and the product's own rounding;
- the softmax ``p = softmax(s)`` along a row of ``S`` scores with errors ``es``:
  ``ep_j = p_j (es_j + sum_k p_k es_k + g(S))`` (from ``dp_j = p_j (ds_j - sum_k p_k ds_k)``,
  plus the roundings of ``exp`` and of the normalising sum);
- sums over tokens, heads and replicas: ``g(n) sum |terms|``.

Why ``sqrt(K)`` and root-sum-squares rather than Higham's worst case (``K u``, errors summed in
absolute value): the bounds compose, and through the scores (a product of two projections), the
softmax (sensitive to *absolute* score errors) and the out-projection (4096 carried errors summed)
worst-case bounds compound into a bound larger than the values at a realistic size (hidden 4096,
32 heads, 128 tokens: about 9 times the output), which would accept any bug — the softmax scale of
the ``attention-local-head-dim-scale`` mutant passed. Rounding errors behave like independent
random signs, both when a sum accumulates them and when a product carries them; the linear-layer
checks rest on the same model.

The tolerance is :data:`SECOND_ORDER` times the propagated bound: the first-order bound leaves out
products of errors, smaller than the bound itself while the bound is small against the values —
true in float64 and float32 (the family refuses bfloat16 and float16: there the bound through a
softmax is as large as the bugs it looks for).

``kv_map`` (query head -> key/value head) and ``scale_factor`` recompute the attention a buggy block
computes: the recognisers of :mod:`tpsim.props.attention.checks` use them as positive evidence.
"""

from __future__ import annotations

import math

import torch

from tpsim.props.tolerance import FACTOR

__all__ = ["SECOND_ORDER", "attention_reference"]

#: First-order bound -> tolerance (see the module docstring).
SECOND_ORDER = 2.0
_F64 = torch.float64


def _g(k: int, u: float) -> float:
    """The rounding bound of a sum of ``k`` products, relative to the sum of their magnitudes."""
    return FACTOR * u * math.sqrt(k + 2)


def _mm(a: torch.Tensor, ea: torch.Tensor, b: torch.Tensor, eb: torch.Tensor, k: int,
        u: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``a @ b`` and its error bound for a reduction of length ``k``: the errors of the operands carried
    through (root-sum-square: independent errors), plus the rounding of the product itself."""
    carried = ((ea * ea) @ (b * b) + (a * a) @ (eb * eb)).sqrt()
    return a @ b, carried + _g(k, u) * (a.abs() @ b.abs())


def attention_reference(
    masters: dict[str, torch.Tensor | None],
    x: torch.Tensor,
    gy: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    causal: bool,
    world_size: int,
    dtype: torch.dtype,
    scale_factor: float = 1.0,
    kv_map: list[int] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Forward and backward of the attention in float64; ``{name: (value, tolerance)}`` for ``y``
    (the output), ``x`` (its grad) and every parameter grad (``qkv.weight``, ``qkv.bias``,
    ``proj.weight``, ``proj.bias``; biases only when ``masters`` has them).

    ``masters``: the parameters as :class:`tpsim.layers.DenseAttention` names them; ``x``:
    ``[..., S, hidden]``; ``gy``: the upstream grad of the output; ``world_size``: the tp size (the
    sharded block's extra partial sums)."""
    u = float(torch.finfo(dtype).eps)
    h, g, d, ws = num_heads, num_kv_heads, head_dim, world_size
    kv_map = list(kv_map) if kv_map is not None else [i // (h // g) for i in range(h)]
    scale = scale_factor / math.sqrt(d)
    w, wo = masters["qkv.weight"].to(_F64), masters["proj.weight"].to(_F64)  # type: ignore[union-attr]
    has_bias = masters.get("qkv.bias") is not None
    b = masters["qkv.bias"].to(_F64) if has_bias else torch.zeros(w.shape[0], dtype=_F64)  # type: ignore[union-attr]
    bo = masters["proj.bias"].to(_F64) if has_bias else torch.zeros(wo.shape[0], dtype=_F64)  # type: ignore[union-attr]
    x, gy = x.to(_F64), gy.to(_F64)
    hidden, s = x.shape[-1], x.shape[-2]
    tokens = x.numel() // hidden
    zero = torch.zeros_like

    def heads(t: torch.Tensor, n: int) -> torch.Tensor:  # [..., S, n*d] -> [..., n, S, d]
        return t.unflatten(-1, (n, d)).transpose(-3, -2)

    def merge(t: torch.Tensor) -> torch.Tensor:  # [..., n, S, d] -> [..., S, n*d]
        return t.transpose(-3, -2).flatten(-2)

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(tokens, t.shape[-1])

    # forward: qkv = x Wᵀ + b
    qkv, e_qkv = _mm(x, zero(x), w.T, zero(w.T), hidden, u)
    qkv, e_qkv = qkv + b, e_qkv + u * b.abs()
    sizes = (h * d, g * d, g * d)
    q, k, v = (heads(t, n) for t, n in zip(qkv.split(sizes, -1), (h, g, g), strict=True))
    eq, ek, ev = (heads(t, n) for t, n in zip(e_qkv.split(sizes, -1), (h, g, g), strict=True))
    idx = torch.tensor(kv_map)
    kx, ekx, vx, evx = (t.index_select(-3, idx) for t in (k, ek, v, ev))  # per query head
    sc, e_sc = _mm(q, eq, kx.transpose(-1, -2), ekx.transpose(-1, -2), d, u)
    sc, e_sc = sc * scale, e_sc * scale
    mask = torch.ones(s, s, dtype=torch.bool)
    if causal:
        mask = mask.tril()
    p = torch.softmax(sc.masked_fill(~mask, float("-inf")), -1)
    e_sc = e_sc.masked_fill(~mask, 0.0)
    ep = p * (e_sc + (p * e_sc).sum(-1, keepdim=True) + _g(s, u))
    o, eo = _mm(p, ep, vx, evx, s, u)
    o, eo = merge(o), merge(eo)
    y, ey = _mm(o, eo, wo.T, zero(wo.T), h * d + ws, u)
    y, ey = y + bo, ey + u * bo.abs()

    # backward
    g_o, eg_o = _mm(gy, zero(gy), wo, zero(wo), hidden, u)
    g_wo, eg_wo = _mm(flat(gy).T, zero(flat(gy).T), flat(o), flat(eo), tokens, u)
    g_bo, eg_bo = flat(gy).sum(0), _g(tokens, u) * flat(gy).abs().sum(0)
    g_o, eg_o = heads(g_o, h), heads(eg_o, h)
    g_vx, eg_vx = _mm(p.transpose(-1, -2), ep.transpose(-1, -2), g_o, eg_o, s, u)
    g_p, eg_p = _mm(g_o, eg_o, vx.transpose(-1, -2), evx.transpose(-1, -2), d, u)
    dot = (p * g_p).sum(-1, keepdim=True)
    e_dot = (ep * g_p.abs() + p * eg_p).sum(-1, keepdim=True) + _g(s, u) * (p * g_p.abs()).sum(-1, keepdim=True)
    g_sc = p * (g_p - dot)
    eg_sc = ep * (g_p.abs() + dot.abs()) + p * (eg_p + e_dot) + 2 * u * p * (g_p.abs() + dot.abs())
    g_q, eg_q = _mm(g_sc, eg_sc, kx, ekx, s, u)
    g_kx, eg_kx = _mm(g_sc.transpose(-1, -2), eg_sc.transpose(-1, -2), q, eq, s, u)
    g_q, eg_q, g_kx, eg_kx = g_q * scale, eg_q * scale, g_kx * scale, eg_kx * scale

    def group_sum(t: torch.Tensor, et: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # per query head -> per key/value head; the sum over a group's heads (and replicas) rounds too
        shape = list(t.shape)
        shape[-3] = g
        out = torch.zeros(shape, dtype=_F64).index_add_(-3, idx, t)
        err = torch.zeros(shape, dtype=_F64).index_add_(-3, idx, et)
        mag = torch.zeros(shape, dtype=_F64).index_add_(-3, idx, t.abs())
        return out, err + _g(h // g + ws, u) * mag

    g_k, eg_k = group_sum(g_kx, eg_kx)
    g_v, eg_v = group_sum(g_vx, eg_vx)
    g_qkv = torch.cat([merge(g_q), merge(g_k), merge(g_v)], -1)
    eg_qkv = torch.cat([merge(eg_q), merge(eg_k), merge(eg_v)], -1)
    g_x, eg_x = _mm(g_qkv, eg_qkv, w, zero(w), w.shape[0] + ws, u)
    g_w, eg_w = _mm(flat(g_qkv).T, flat(eg_qkv).T, flat(x), zero(flat(x)), tokens + ws, u)
    g_b = flat(g_qkv).sum(0)
    eg_b = flat(eg_qkv).sum(0) + _g(tokens + ws, u) * flat(g_qkv).abs().sum(0)
    out = {"y": (y, ey), "x": (g_x, eg_x), "qkv.weight": (g_w, eg_w), "proj.weight": (g_wo, eg_wo)}
    if has_bias:
        out["qkv.bias"] = (g_b, eg_b)
        out["proj.bias"] = (g_bo, eg_bo)
    # The floor of tpsim.props.tolerance: a bound of zero (all magnitudes zero) is not a strict equality test.
    return {name: (value, SECOND_ORDER * err + 1e-300) for name, (value, err) in out.items()}
