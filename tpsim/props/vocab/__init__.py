"""The vocab-parallel families of checks: embeddings (``--kind embedding``) and cross-entropies
(``--kind cross-entropy``) against ``nn.Embedding`` and ``F.cross_entropy`` in float64.

- :mod:`tpsim.props.vocab.case` — :class:`EmbeddingCase`, :class:`CrossEntropyCase` (pure data);
- :mod:`tpsim.props.vocab.strategies` — Hypothesis strategies for them;
- :mod:`tpsim.props.vocab.world` — the data of a case, the rank side, the float64 reference;
- :mod:`tpsim.props.vocab.checks` — the properties, their tolerances and the diagnoses' recognisers;
- :mod:`tpsim.props.vocab.family` — :data:`EMBEDDING` and :data:`CROSS_ENTROPY`, the family objects
  (:mod:`tpsim.props.family`) that the search, the CLI, case files and replay talk to.

The variant types live in :mod:`tpsim.vocab_variant`.
"""
