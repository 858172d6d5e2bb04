"""The attention family of checks: head-sharded attention blocks against tpsim's dense attention.

- :mod:`tpsim.props.attention.case` — :class:`AttentionCase` (pure data);
- :mod:`tpsim.props.attention.strategies` — its Hypothesis strategy (head counts across tp sizes);
- :mod:`tpsim.props.attention.reference` — the dense attention in float64 and its twin's bounds
  (the tolerances, in every dtype);
- :mod:`tpsim.props.attention.world` — the data of a case and the rank side;
- :mod:`tpsim.props.attention.checks` — the properties and the attention diagnoses' recognisers;
- :mod:`tpsim.props.attention.family` — :data:`ATTENTION`, the family object.

The variant type lives in :mod:`tpsim.attention_variant`.
"""
