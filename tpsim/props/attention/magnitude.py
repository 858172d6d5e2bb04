"""A magnitude rule for ``F.scaled_dot_product_attention``: whole-module checks of attention blocks.

The module family (:mod:`tpsim.props.module.magnitude`) derives a module's tolerances from a
*magnitude run*: the dense module in float64 on absolute values, every operation replaced by one
whose result bounds the magnitudes (and, in backward, the grad magnitudes) the first-order error
analysis needs. Attention is not a linear map, so it needs its own rule; registered with
:func:`tpsim.props.module.magnitude.register_rule` (:func:`register`, called when the attention
family loads, which every search does), it lets ``tpsim check FILE:Class --kind module`` check a
user's attention block.

A magnitude run only sees magnitudes ``Q, K, V`` (bounds of the values, in units in which their
rounding errors are ``~ eps * K * magnitude``), never the probabilities themselves, so the rule
bounds every convex combination by its largest term. With ``S_ij = scale * Q_i . K_j`` over the
allowed keys ``j`` (causal: ``j <= i``), ``A_i = max_j S_ij``, ``Vmax_i = max_j V_j`` and, backward,
``P_i = max_j G_i . V_j`` (``G``: the magnitude of the output's grad):

- forward ``O_i = Vmax_i (2 + 2 A_i)``: ``|o_i| <= Vmax_i``; an error ``e_v`` in the values moves
  ``o_i`` by at most ``max_j e_v``; an error ``e_s`` in the scores moves each ``p_ij`` by at most
  ``2 p_ij max_j e_s`` (``dp = p (ds - sum p ds)``), so ``o_i`` by ``2 A_i Vmax_i`` in magnitude units;
- backward ``G_V_j = sum_i G_i (2 + 2 A_i)`` (``g_v = pᵀ g_o`` with ``p <= 1``, plus the errors of ``p``
  and of ``g_o``); ``G_Q_i = scale P_i Kmax_i (8 + 6 A_i)`` and ``G_K_j = scale sum_i P_i (8 + 6 A_i) Q_i``
  (``g_s = p (g_p - sum p g_p)`` is at most ``2 p P``; the errors of ``p``, of ``g_p = g_o vᵀ`` and of
  ``q``/``k`` add ``6 p A P``, ``4 p P`` and ``2 p P`` more).

The forward counts two reductions (the head dim and the keys) and the stages of its operands plus
two (scores, then the weighted sum).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tpsim.props.module.magnitude import UnboundedOp, register_rule

__all__ = ["register", "sdpa_rule"]


def _allowed(length: int, keys: int, causal: bool, device: torch.device) -> torch.Tensor:
    mask = torch.ones(length, keys, dtype=torch.bool, device=device)
    return mask.tril() if causal else mask


class _SDPAMagnitude(torch.autograd.Function):
    """The bounds of the module docstring, forward and backward (float64 magnitudes in, out)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                groups: int) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            kx = k.repeat_interleave(groups, dim=-3) if groups > 1 else k  # per query head
            vx = v.repeat_interleave(groups, dim=-3) if groups > 1 else v
            allowed = _allowed(q.shape[-2], k.shape[-2], causal, q.device)  # [L, S]
            s = (q @ kx.transpose(-1, -2)) * scale * allowed  # [..., L, S]
            a = s.amax(-1, keepdim=True)  # [..., L, 1]
            big = torch.finfo(v.dtype).max
            # max over the allowed keys of each value feature: [..., L, Ev]
            vmax = vx.unsqueeze(-3).masked_fill(~allowed.unsqueeze(-1), -big).amax(-2).clamp_min(0.0)
            kmax = kx.unsqueeze(-3).masked_fill(~allowed.unsqueeze(-1), -big).amax(-2).clamp_min(0.0)
        ctx.save_for_backward(q, kx, vx, a, kmax)
        ctx.scale, ctx.causal, ctx.groups = scale, causal, groups
        return vmax * (2.0 + 2.0 * a)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, kx, vx, a, kmax = ctx.saved_tensors
        allowed = _allowed(q.shape[-2], kx.shape[-2], ctx.causal, q.device)
        p = ((grad @ vx.transpose(-1, -2)) * allowed).amax(-1, keepdim=True)  # [..., L, 1]
        weight = p * (8.0 + 6.0 * a)  # [..., L, 1]
        g_q = ctx.scale * weight * kmax  # [..., L, E]
        g_kx = ctx.scale * (allowed * weight).transpose(-1, -2) @ q  # [..., S, E]
        g_vx = (allowed * (2.0 + 2.0 * a)).transpose(-1, -2) @ grad  # [..., S, Ev]
        if ctx.groups > 1:  # back from query heads to their key/value heads
            def fold(t: torch.Tensor) -> torch.Tensor:
                return t.unflatten(-3, (t.shape[-3] // ctx.groups, ctx.groups)).sum(-3)

            g_kx, g_vx = fold(g_kx), fold(g_vx)
        return g_q, g_kx, g_vx, None, None, None


def sdpa_rule(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mode: Any) -> torch.Tensor:
    """The magnitude rule of ``scaled_dot_product_attention`` (see the module docstring)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    if bound.get("attn_mask") is not None:
        raise UnboundedOp("scaled_dot_product_attention(attn_mask=...): only is_causal masking has a rule")
    if bound.get("dropout_p", 0.0):
        raise UnboundedOp(f"scaled_dot_product_attention(dropout_p={bound['dropout_p']}): random; check in eval mode")
    scale = bound.get("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else abs(float(scale))
    groups = q.shape[-3] // k.shape[-3] if q.dim() >= 3 and k.dim() >= 3 else 1
    out = _SDPAMagnitude.apply(q, k, v, scale, bool(bound.get("is_causal", False)), groups)
    mode.reduce(q.shape[-1] + k.shape[-2])
    return mode.mark(out, mode.stages_of(q) + mode.stages_of(k) + mode.stages_of(v) + 2)


def register() -> None:
    """Register :func:`sdpa_rule` with the module family's magnitude run."""
    register_rule("scaled_dot_product_attention", sdpa_rule)
