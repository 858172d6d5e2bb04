"""The Hypothesis strategy of a transformers module's sizes and switches (the family's rules decide).

A case of a module (:mod:`tpsim.presets.hf.discovery`) draws, for a tp group of ``tp`` ranks:

- ``kv_heads``: ``tp`` times 1 or 2 where the plan shards attention heads (each rank holds whole
  heads: transformers' own rule, ``get_kv_heads_per_rank``), else 1 or 2 whatever the tp size (fewer
  key/value heads than ranks); ``heads``: the key/value heads times 1 or 2 (grouped-query), or equal
  to them (a multi-head or latent-attention config);
- ``hidden``: ``heads * head_dim`` (twice that too where the config sets ``head_dim`` itself), a
  multiple of the tp size; without heads, ``8 * tp`` or ``16 * tp``;
- ``ffn``: ``4 * tp`` or ``8 * tp`` (every intermediate size of the config: dense, experts', shared);
- ``experts``: 2, 3 or 4 and ``top_k`` 2 (top-1 with normalised weights leaves the router no grad);
- each switch 0 or 1 (:class:`~tpsim.presets.hf.discovery.Switch`), and ``layer``: which of the
  layers that hold the module (a sliding and a full one, a dense and an MoE one, ...).

A drawn tuple is kept only where the family's config class accepts it (its validators run). Sizes
that do not divide by the tp size are not drawn: a plan's DTensor shards them unevenly by design.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tpsim.presets.hf.discovery import Described, Root

__all__ = ["SizeRule"]


#: What :func:`_valid` found, by the repr of its arguments (a config's base holds lists: not hashable).
_VALID: dict[str, bool] = {}


def _valid(config: str, model: str, base: tuple[tuple[str, Any], ...], values: tuple[int, ...],
           names: tuple[str, ...], switches: tuple[tuple[str, Any], ...]) -> bool:
    """Whether the family accepts these sizes: its config's validators, and its model's constructor
    (built on the meta device: some modeling code refuses sizes the config lets through, e.g. an odd
    number of key/value heads for a differential attention). Refused values are no case of it."""
    key = repr((config, model, base, values, names, switches))
    if key not in _VALID:
        _VALID[key] = _accepted(config, model, base, values, names, switches)
    return _VALID[key]


def _accepted(config: str, model: str, base: tuple[tuple[str, Any], ...], values: tuple[int, ...],
              names: tuple[str, ...], switches: tuple[tuple[str, Any], ...]) -> bool:
    from tpsim.presets.hf.configs import config_for
    from tpsim.presets.hf.discovery import _dense_runs, check_tiny
    from tpsim.presets.hf.modules import _resolve

    drawn = {k: v for k, v in zip(names, values, strict=True) if k not in dict(switches)}
    try:
        config = config_for(_resolve(config), dict(base), drawn, dict(switches))
        check_tiny(_resolve(model), config)  # built on the meta device
    except Exception:  # noqa: BLE001 - the family refuses these values
        return False
    # Some modeling code refuses sizes only in its forward (product-key experts need a square expert
    # count): the dense tiny model runs once on token ids, densely, as the model a user builds would.

    return _dense_runs(config, model)


@dataclass(frozen=True)
class SizeRule:
    """``rule(tp, divisible)``: the strategy of one module's size tuples (see the module docstring)."""

    described: Described
    root: Root

    def __call__(self, tp: int, divisible: bool) -> Any:
        from hypothesis import assume
        from hypothesis import strategies as st

        if not divisible:
            return st.nothing()
        described, root = self.described, self.root
        names = described.names_of(root)
        base_key = described.base

        @st.composite
        def draw(d: Any) -> tuple[int, ...]:
            out: dict[str, int] = {}
            if "heads" in names:
                kv = (tp if described.shard_heads else 1) * d(st.integers(1, 2))
                heads = kv if described.mha else kv * d(st.integers(1, 2))
                assume(not described.shard_heads or heads % tp == 0)
                out["heads"] = heads
                if "kv_heads" in names:
                    out["kv_heads"] = kv
                width = described.head_dim * heads
                out["hidden"] = width * (d(st.integers(1, 2)) if described.head_dim_explicit else 1)
            else:
                out["hidden"] = 8 * tp * d(st.integers(1, 2))
            assume(out["hidden"] % tp == 0)
            if "ffn" in names:
                out["ffn"] = 4 * tp * d(st.integers(1, 2))
            if "experts" in names:
                out["experts"] = d(st.integers(2, 4))
            if "top_k" in names:
                # 2: with one expert per token a router that normalises its top-k weights has weight 1
                # whatever its logits, so its grad is exactly zero and is judged against rounding alone
                out["top_k"] = 2
            for name in root.switches:
                out[name] = d(st.integers(0, 1))
            if "layer" in names:
                out["layer"] = d(st.integers(0, len(root.layers) - 1))
            values = tuple(out[n] for n in names)
            switches = {s.attr: (s.on if out.get(s.name) else s.off) for s in described.switches
                        if s.name in root.switches and not s.attr.startswith("_")}
            assume(_valid(described.config, described.model, base_key, values, names,
                          tuple(sorted(switches.items()))))
            return values

        return draw()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SizeRule) and (other.described.config, other.root.name) == (
            self.described.config, self.root.name)

    def __hash__(self) -> int:
        return hash((self.described.config, self.root.name))
