"""What a finished world returns, whichever backend ran it.

A leaf module (it imports only the trace records), so the backends can build a
:class:`WorldResult` without importing the runner that dispatches to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tpsim.comm.trace import Trace

__all__ = ["WorldResult"]


@dataclass
class WorldResult:
    """What a finished world returns: ``values[r]`` is rank r's return value."""

    values: list[Any]
    trace: Trace = field(default_factory=Trace)
    backend: str = "inproc"
    #: ``(fault, call)`` for every fault of the plan that acted, and the call it acted on.
    faults_fired: list[tuple[Any, Any]] = field(default_factory=list)
