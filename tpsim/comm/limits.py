"""Bounds on what a world may take from this machine: how many ranks, and how much memory.

World sizes are refused *before* anything starts, so a typo such as ``--world-sizes 1000`` cannot
fork a thousand processes onto a two-core machine:

=========  ===================================================================================
backend    largest world (override: the environment variable ``TPSIM_MAX_WORLD_SIZE``)
=========  ===================================================================================
``gloo``   :data:`RANKS_PER_CPU` × the CPUs this process may use: every rank is a process that
           imports torch (~300 MB resident) and competes for the cores
``nccl``   the same bound (one process per rank; the GPU count is checked separately)
``inproc`` the memory available now divided by :data:`INPROC_RANK_BYTES` (a rank's thread, its
           process group and the small tensors of a check), at most :data:`INPROC_CAP` and at
           least :data:`INPROC_FLOOR`
=========  ===================================================================================

:func:`check_world_size` is the one place that applies them: the world runner, the search's
options and case-file loading all call it.

The isolated inproc worker (:mod:`tpsim.comm.isolate`) also gets an address-space limit
(:func:`worker_memory_limit`), so a runaway allocation fails inside the worker with a clear
"can't allocate memory" instead of the kernel's out-of-memory killer choosing the checker.
"""

from __future__ import annotations

import os
import re

from tpsim.errors import InvalidArgument

__all__ = [
    "INPROC_CAP",
    "INPROC_FLOOR",
    "INPROC_RANK_BYTES",
    "MAX_WORLD_SIZE_ENV",
    "RANKS_PER_CPU",
    "WORKER_MEMORY_ENV",
    "check_world_size",
    "max_world_size",
    "nccl_unavailable_reason",
    "usable_cpus",
    "worker_memory_limit",
]

#: Environment variable that replaces every backend's world-size limit (a whole number >= 1).
MAX_WORLD_SIZE_ENV = "TPSIM_MAX_WORLD_SIZE"
#: Environment variable setting how much address space the isolated worker's ranks may map beyond
#: what the worker starts with: bytes, or a number with a K/M/G/T suffix (``16G``);
#: ``0``/``none``/``unlimited`` turns the limit off.
WORKER_MEMORY_ENV = "TPSIM_WORKER_MEMORY"

#: gloo/nccl: ranks per usable CPU. Beyond a few processes per core a world only thrashes.
RANKS_PER_CPU = 4
#: inproc: memory set aside per rank when deriving the limit from the available memory. A bare
#: rank costs ~0.1 MB resident (measured: 512 ranks of an all_reduce add ~50 MB); checks hold a few
#: small tensors per rank on top. The 40x margin keeps a large world of a real layer within memory.
INPROC_RANK_BYTES = 4 << 20
#: inproc: the limit never exceeds this (a world of threads this large is already a stress test).
INPROC_CAP = 1024
#: inproc: the limit is never below this, however little memory is available now.
INPROC_FLOOR = 64
#: The isolated worker's address-space limit is never below this: torch maps ~1-2 GB of virtual
#: memory (libraries, per-thread malloc arenas) before it allocates anything.
_WORKER_MEMORY_FLOOR = 8 << 30

_BACKENDS = ("inproc", "gloo", "nccl")


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except OSError:
            pass
    return max(1, os.cpu_count() or 1)


def nccl_unavailable_reason(world_size: int) -> str | None:
    """Why an nccl world of ``world_size`` ranks cannot run here (one line), or None if it can."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return "this torch build has no torch.distributed support"
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return f"CUDA is not available (torch {torch.__version__} is {build}; nccl needs NVIDIA GPUs)"
    if not dist.is_nccl_available():
        return f"torch {torch.__version__} was built without NCCL support"
    found = torch.cuda.device_count()
    if found < world_size:
        return f"world_size={world_size} needs {world_size} GPUs (one process per GPU), found {found}"
    return None


def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (empty where there is none)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    out[name] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _available_memory() -> int | None:
    """Bytes of memory available for new allocations now, or None where that is unknown."""
    info = _meminfo()
    if "MemAvailable" in info:
        return info["MemAvailable"]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _env_limit() -> int | None:
    raw = os.environ.get(MAX_WORLD_SIZE_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise InvalidArgument(
            f"environment variable {MAX_WORLD_SIZE_ENV}={raw!r} must be a whole number >= 1 "
            "(the largest world size to allow on any backend)"
        )
    return int(raw)


def max_world_size(backend: str) -> tuple[int, str]:
    """``(limit, why)``: the largest world ``backend`` accepts here and how it was derived."""
    if backend not in _BACKENDS:
        raise InvalidArgument(f"backend={backend!r} is not one of {', '.join(_BACKENDS)}")
    override = _env_limit()
    if override is not None:
        return override, f"set by {MAX_WORLD_SIZE_ENV}"
    if backend in ("gloo", "nccl"):
        cpus = usable_cpus()
        return RANKS_PER_CPU * cpus, f"{RANKS_PER_CPU} processes per CPU × {cpus} usable CPUs"
    free = _available_memory()
    if free is None:
        return INPROC_CAP, "the cap for rank threads (available memory unknown)"
    by_memory = free // INPROC_RANK_BYTES
    limit = max(INPROC_FLOOR, min(INPROC_CAP, by_memory))
    why = f"{free / 2**30:.1f} GiB available / {INPROC_RANK_BYTES >> 20} MiB per rank"
    if by_memory > INPROC_CAP:
        why += f", capped at {INPROC_CAP}"
    elif by_memory < INPROC_FLOOR:
        why += f", raised to the floor of {INPROC_FLOOR}"
    return limit, why


def check_world_size(world_size: int, backend: str) -> None:
    """Raise :class:`tpsim.InvalidArgument` unless ``world_size`` ranks fit ``backend`` here.

    The message names the limit, how it was derived and the override (``TPSIM_MAX_WORLD_SIZE``).
    Nothing is started before this check passes.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgument(f"world_size={world_size!r} must be an int >= 1")
    if backend == "inproc" and world_size <= INPROC_FLOOR and not os.environ.get(MAX_WORLD_SIZE_ENV):
        return  # within the floor: no need to read the available memory (this runs before every world)
    limit, why = max_world_size(backend)
    if world_size > limit:
        raise InvalidArgument(
            f"world_size={world_size} is above the {backend} limit of {limit} ranks on this machine ({why}); "
            f"use a smaller world, or raise the limit with the environment variable "
            f"{MAX_WORLD_SIZE_ENV}={world_size} if the machine can take it"
        )


_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def worker_memory_limit() -> int | None:
    """Bytes of address space the isolated worker's ranks may map beyond what the worker starts with
    (a worker forked from the checker starts with the checker's); None: no limit.

    Default: the machine's memory plus swap (at least 8 GiB), plus room for the stacks of
    :data:`INPROC_CAP` rank threads (address space each thread reserves, mostly never touched) — a
    world never needs more than the machine can back, so an allocation beyond it is a runaway. Set
    ``TPSIM_WORKER_MEMORY`` (``16G``, ``512M``, bytes; ``0``/``none``/``unlimited`` for no limit).
    """
    raw = os.environ.get(WORKER_MEMORY_ENV, "").strip()
    if raw:
        if raw.lower() in ("0", "none", "unlimited"):
            return None
        m = re.fullmatch(r"(\d+)\s*([KMGT]?)(?:i?B)?", raw, flags=re.IGNORECASE)
        if m is None or int(m.group(1)) < 1:
            raise InvalidArgument(
                f"environment variable {WORKER_MEMORY_ENV}={raw!r}: expected bytes or a number with a K/M/G/T "
                "suffix (e.g. 16G), or 0/none/unlimited for no limit"
            )
        return int(m.group(1)) * _SUFFIX[m.group(2).upper()]
    info = _meminfo()
    total = info.get("MemTotal", 0) + info.get("SwapTotal", 0)
    if total <= 0:
        return None
    return max(total, _WORKER_MEMORY_FLOOR) + INPROC_CAP * _thread_stack_bytes()


def _thread_stack_bytes() -> int:
    """Address space a new thread reserves for its stack (the soft stack limit; 8 MiB if unlimited)."""
    import threading

    size = threading.stack_size()
    if size:
        return size
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_STACK)[0]
    except (ImportError, ValueError, OSError):
        return 8 << 20
    return soft if 0 < soft != resource.RLIM_INFINITY else 8 << 20
