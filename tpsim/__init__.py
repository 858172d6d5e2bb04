"""tpsim: a simulated-cluster correctness and fault-testing harness for tensor-parallel layers.

The public API is re-exported here; the modules behind it are private to the package.
``tpsim.faults`` (fault plans) and ``tpsim.layers`` (the layer core) are public submodules.
"""

from tpsim import faults
from tpsim.comm.trace import CollectiveCall, Trace
from tpsim.errors import BackendUnavailable, CollectiveError, InvalidArgument, RankError, TpsimError
from tpsim.placement import Partial, Placement, Replicate, Shard
from tpsim.runner import BACKENDS, DEFAULT_TIMEOUT, WorldResult, run, run_world
from tpsim.variant import ParamSpec, Variant

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT",
    "BackendUnavailable",
    "CollectiveCall",
    "CollectiveError",
    "InvalidArgument",
    "ParamSpec",
    "Partial",
    "Placement",
    "RankError",
    "Replicate",
    "Shard",
    "TpsimError",
    "Trace",
    "Variant",
    "WorldResult",
    "__version__",
    "faults",
    "run",
    "run_world",
]
