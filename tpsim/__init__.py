"""tpsim: a simulated-cluster correctness and fault-testing harness for tensor-parallel layers.

The public API is re-exported here; the modules behind it are private to the package.
``tpsim.faults`` (fault plans) and ``tpsim.layers`` (the layer core) are public submodules.
"""

from tpsim import faults
from tpsim.attention_variant import AttentionVariant
from tpsim.comm.rank_progress import mark_phase
from tpsim.comm.trace import CollectiveCall, Trace
from tpsim.errors import (
    BackendUnavailable,
    CollectiveError,
    CollectiveOnStridedView,
    InvalidArgument,
    RankCrashed,
    RankDied,
    RankError,
    RankExited,
    SharedModuleState,
    TpsimError,
)
from tpsim.module_variant import ModuleVariant
from tpsim.placement import Partial, Placement, Replicate, Shard
from tpsim.runner import BACKENDS, DEFAULT_TIMEOUT, WorldResult, run, run_world
from tpsim.variant import ParamSpec, Variant
from tpsim.vocab_variant import CrossEntropyVariant, EmbeddingVariant

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT",
    "AttentionVariant",
    "BackendUnavailable",
    "CollectiveCall",
    "CollectiveError",
    "CollectiveOnStridedView",
    "CrossEntropyVariant",
    "EmbeddingVariant",
    "InvalidArgument",
    "ModuleVariant",
    "ParamSpec",
    "Partial",
    "Placement",
    "RankCrashed",
    "RankDied",
    "RankError",
    "RankExited",
    "Replicate",
    "Shard",
    "SharedModuleState",
    "TpsimError",
    "Trace",
    "Variant",
    "WorldResult",
    "__version__",
    "faults",
    "mark_phase",
    "run",
    "run_world",
]
