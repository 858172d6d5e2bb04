"""tpsim: a simulated-cluster correctness and fault-testing harness for tensor-parallel layers.

The public API is re-exported here; the modules behind it are private to the package.
"""

from tpsim.comm.trace import CollectiveCall, Trace
from tpsim.errors import BackendUnavailable, CollectiveError, InvalidArgument, RankError, TpsimError
from tpsim.runner import BACKENDS, DEFAULT_TIMEOUT, WorldResult, run, run_world

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT",
    "BackendUnavailable",
    "CollectiveCall",
    "CollectiveError",
    "InvalidArgument",
    "RankError",
    "TpsimError",
    "Trace",
    "WorldResult",
    "__version__",
    "run",
    "run_world",
]
