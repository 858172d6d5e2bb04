"""The names of the properties, which every family reports its failures under.

A leaf module: the modules that judge a run (:mod:`tpsim.props.linear.checks`, :mod:`tpsim.props.blame`,
each family's checks) all name properties, and none of them may import another just for its names.
"""

from __future__ import annotations

__all__ = [
    "FORWARD_ONLY",
    "BIAS_GRAD",
    "DIVISIBILITY",
    "FORWARD",
    "INPUT_GRAD",
    "PROPERTIES",
    "REPLICA",
    "TRAINING",
    "WEIGHT_GRAD",
    "property_of_phase",
]

FORWARD = "forward-equivalence"
INPUT_GRAD = "input-grad-equivalence"
WEIGHT_GRAD = "weight-grad-equivalence"
BIAS_GRAD = "bias-grad-equivalence"
REPLICA = "replica-consistency"
TRAINING = "training-equivalence"
DIVISIBILITY = "divisibility"

#: Every property name, in the order they are evaluated and reported.
PROPERTIES = (FORWARD, INPUT_GRAD, WEIGHT_GRAD, BIAS_GRAD, REPLICA, TRAINING, DIVISIBILITY)
#: The properties of a forward-only (inference) variant: no grads, no training.
FORWARD_ONLY = (FORWARD, REPLICA, DIVISIBILITY)


def property_of_phase(phase: str | None, step: int | None, backward: str = INPUT_GRAD) -> str:
    """The property a failure in ``phase`` of SGD ``step`` counts under: any phase after step 0 is
    training; at step 0 the backward counts under ``backward`` (the input grad, or the table's grad
    of an embedding, which has no input grad), the SGD step under training, the rest (build,
    forward, an unknown phase) under the forward."""
    if step is not None and step > 0:
        return TRAINING
    return {"backward": backward, "step": TRAINING}.get(phase or "", FORWARD)
