"""Hugging Face transformers models, found and built generically for the transformers preset.

Every ``transformers.models.<family>`` whose config classes define a ``base_model_tp_plan`` is checked
module by module (:mod:`tpsim.presets.transformers`), with nothing written per family:

- :mod:`tpsim.presets.hf.configs`: which config classes of a family define a plan, the model class
  that runs each, and a tiny config of given sizes (the family's own validators decide what is valid);
- :mod:`tpsim.presets.hf.discovery`: the modules a plan shards (decoder layers, their attention, MLP
  and MoE blocks, embeddings, the head), the config switches that change them, how each is called;
- :mod:`tpsim.presets.hf.modules`: the dense builder of one such module, called as the model calls it;
- :mod:`tpsim.presets.hf.sizes`: the Hypothesis strategy of a family's sizes and switches.
"""
