"""Whole modules as check targets: an MLP or a block, checked against itself on one rank.

- :mod:`tpsim.props.module.case` — :class:`ModuleCase`, one example (sizes, batch, dtype, seed);
- :mod:`tpsim.props.module.strategies` — the Hypothesis strategy of module cases;
- :mod:`tpsim.props.module.sharding` — each parameter's layout, declared or read from shapes;
- :mod:`tpsim.props.module.magnitude` — the magnitude run that derives the tolerances;
- :mod:`tpsim.props.module.boundary` — sublayer boundaries, recorded forward and backward;
- :mod:`tpsim.props.module.world` — the reference world (one rank) and the tp world of a case;
- :mod:`tpsim.props.module.checks` — the properties, and the sublayer a failure comes from;
- :mod:`tpsim.props.module.family` — the ``module`` family (:class:`tpsim.props.family.Family`).

The variant type is :class:`tpsim.module_variant.ModuleVariant`.
"""
