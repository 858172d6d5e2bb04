"""Single tensor-parallel linear layers as check targets (the ``linear`` family).

- :mod:`tpsim.props.linear.case` — :class:`Case`, one example (features, batch, layout, dtype, bias, seed);
- :mod:`tpsim.props.linear.strategies` — the Hypothesis strategy of linear cases;
- :mod:`tpsim.props.linear.world` — one world run per case and the float64 dense ``x Wᵀ + b``
  (computed by the process that judges);
- :mod:`tpsim.props.linear.checks` — the registry of its checks, their group context and recognisers;
- :mod:`tpsim.props.linear.family` — the ``linear`` family (:class:`tpsim.props.family.Family`) and
  the public property functions, one per property.

The variant type is :class:`tpsim.variant.Variant`.
"""
