"""The benchmark sections: each returns a dict of rows (JSON-ready) for :mod:`bench.report`.

A :class:`Config` says how big the run is (``FULL`` or ``QUICK``). Measurements that start worlds
of processes or threads that could run long run in a fresh ``python -m bench.<module>``
subprocess with a time limit (:func:`subprocess_json`); a limit hit is recorded, never waited out.
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Config:
    """How much each section measures."""

    step_sizes: tuple[int, ...]
    step_steps: int
    step_limit_s: float
    #: interleaved rounds per world size for floor, compute and inproc; each keeps its fastest
    step_repeats: int
    #: rounds for threaded and gloo (slower, and not the headline ratio's denominator)
    step_alone_repeats: int
    gloo_max_ws: int
    prop_examples: int
    prop_world_sizes: tuple[int, ...]
    mutant_examples: int
    mutant_limit: int | None
    lab_hidden: int
    lab_intermediate: int
    lab_tokens: tuple[int, ...]
    fault_backends: tuple[str, ...]
    memory_size: int
    dtensor_examples: int
    #: the ``tpsim check`` commands of the checks section (keys of CHECK_COMMANDS), their rounds, and
    #: arguments appended to every one (a quick run shrinks them)
    check_commands: tuple[str, ...] = ()
    check_rounds: int = 1
    check_extra: tuple[str, ...] = ()
    #: world sizes, collectives per rank (at world size 32: scaled by 32 / world size, at least 50) and
    #: rounds of the inproc per-collective cost measurement (the overhead section)
    overhead_world_sizes: tuple[int, ...] = (8, 32, 128)
    overhead_calls: int = 300
    overhead_repeats: int = 5
    #: world sizes of the inproc rows of the memory section
    memory_world_sizes: tuple[int, ...] = (2, 8)
    #: backends of the props and dtensor sections
    backends: tuple[str, ...] = ("inproc", "gloo")
    #: the scale section: MLP hidden sizes (ffn in the lab note's proportion), vocabulary sizes of the
    #: embedding and cross-entropy cases, and side-by-side rounds per size
    scale_hidden: tuple[int, ...] = (512, 1024, 2048, 4096)
    scale_vocab: tuple[int, ...] = (4096, 8192, 16384, 32000)
    scale_rounds: int = 2
    headline: tuple[int, ...] = (8, 32, 128)
    notes: list[str] = field(default_factory=list)


FULL = Config(
    step_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    step_steps=200,
    step_limit_s=60.0,
    step_repeats=5,
    step_alone_repeats=3,
    gloo_max_ws=8,
    prop_examples=30,
    prop_world_sizes=(1, 2, 3, 4),
    mutant_examples=200,
    mutant_limit=None,
    lab_hidden=4096,
    lab_intermediate=11008,
    lab_tokens=(2, 8),
    fault_backends=("inproc", "gloo"),
    memory_size=4096,
    dtensor_examples=10,
    check_commands=("ws 1-4", "default", "megatron"),
    check_rounds=2,
)
# Every subprocess of the quick run pays python + torch start-up (seconds on a loaded 2-core machine),
# so it starts as few as prove each section runs: one world size per series.
QUICK = Config(
    step_sizes=(2,),
    step_steps=5,
    step_limit_s=60.0,
    step_repeats=1,
    step_alone_repeats=1,
    gloo_max_ws=0,
    prop_examples=3,
    prop_world_sizes=(1, 2),
    mutant_examples=20,
    mutant_limit=2,
    lab_hidden=64,
    lab_intermediate=176,
    lab_tokens=(3, 2),
    fault_backends=("inproc",),
    memory_size=256,
    dtensor_examples=2,
    check_commands=("ws 1-4",),
    check_extra=("--max-examples", "5", "--world-sizes", "1,2"),
    overhead_world_sizes=(4,),
    overhead_calls=50,
    overhead_repeats=2,
    memory_world_sizes=(2,),
    backends=("inproc",),
    headline=(2,),
    scale_hidden=(64,),
    scale_vocab=(256,),
    scale_rounds=1,
)


def subprocess_json(args: list[str], limit: float) -> dict[str, Any] | None:
    """Run ``python -m <args>`` from the repository root; its last stdout line is JSON.
    Returns None when it ran past ``limit`` seconds (the process is killed)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    try:
        done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        raise RuntimeError(f"python -m {' '.join(args)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- 1. collective step vs world size ------------------------------------------------------------


#: measured in one process per world size, interleaved: the ratios between them are the headline
SIDE_BY_SIDE = ("floor", "compute", "inproc")
#: one process each (torch's threaded group takes over the group registry; gloo starts workers)
ALONE = ("threaded", "gloo")
#: a run this long is not repeated: its one sample stands
REPEAT_BELOW_S = 25.0


def step(cfg: Config) -> dict[str, Any]:
    """The collective-step workload per backend and world size (``bench.workload``); None = skipped/too slow.

    floor, compute and inproc run interleaved in one process per world size, ``cfg.step_repeats``
    rounds, fastest kept; threaded and gloo run in processes of their own, ``cfg.step_alone_repeats``
    rounds. The machine is shared: a burst of load then spoils one sample, not a ratio.
    """
    backends = SIDE_BY_SIDE + ALONE
    rows: dict[str, dict[int, float | None]] = {b: {} for b in backends}
    samples: dict[str, dict[int, list[float]]] = {b: {} for b in backends}
    skipped: dict[str, str] = {}

    def run(group: tuple[str, ...], ws: int, repeats: int) -> dict[str, Any] | None:
        # A run over the limit is killed; repeats only happen for runs under REPEAT_BELOW_S.
        args = ["bench.workload", "--backend", *group, "--world-size", str(ws), "--steps", str(cfg.step_steps),
                "--repeats", str(repeats), "--repeat-below", str(REPEAT_BELOW_S)]
        return subprocess_json(args, len(group) * (cfg.step_limit_s + (repeats - 1) * REPEAT_BELOW_S))

    for ws in cfg.step_sizes:
        group = tuple(b for b in SIDE_BY_SIDE if b not in skipped)
        result = run(group, ws, cfg.step_repeats) if group else None
        for b in SIDE_BY_SIDE:
            rows[b][ws] = None if result is None else result["loop_s"].get(b)
            if result is not None and b in result["samples"]:
                samples[b][ws] = result["samples"][b]
        if group and result is None:
            for b in group:
                skipped[b] = f"world size {ws} ran past its time limit; larger sizes skipped"
    for backend in ALONE:
        for ws in cfg.step_sizes:
            if backend in skipped:
                rows[backend][ws] = None
                continue
            if backend == "gloo" and ws > cfg.gloo_max_ws:
                rows[backend][ws] = None
                skipped[backend] = (f"world sizes above {cfg.gloo_max_ws} not run (2-core machine)" if cfg.gloo_max_ws
                                    else "not run in this configuration")
                continue
            try:
                result = run((backend,), ws, cfg.step_alone_repeats)
            except RuntimeError as err:
                if backend != "threaded":
                    raise
                skipped[backend] = f"not importable or failed: {str(err).splitlines()[-1][:200]}"
                rows[backend][ws] = None
                continue
            if result is None:
                rows[backend][ws] = None
                skipped[backend] = f"world size {ws} ran past {cfg.step_limit_s:.0f} s; larger sizes skipped"
                continue
            rows[backend][ws] = result["loop_s"][backend]
            samples[backend][ws] = result["samples"][backend]
    return {"steps": cfg.step_steps, "sizes": list(cfg.step_sizes), "repeats": cfg.step_repeats,
            "alone_repeats": cfg.step_alone_repeats,
            "repeat_below_s": REPEAT_BELOW_S, "seconds": rows, "samples": samples, "skipped": skipped,
            "headline": list(cfg.headline)}


# --- 2. property examples per second, gloo start-up -------------------------------------------------


def _layer_cases(n: int, sizes: tuple[int, ...], seed: int = 0) -> list[Any]:
    from tpsim.props.linear.case import Case

    rng = random.Random(seed)
    out = []
    for i in range(n):
        ws = sizes[i % len(sizes)]
        # both feature dims divide by ws, so column and row variants alike get checkable cases
        out.append(Case(world_size=ws, in_features=ws * rng.randint(1, 4), out_features=ws * rng.randint(1, 3),
                        batch_shape=tuple(rng.randint(1, 3) for _ in range(rng.randint(1, 2))),
                        dtype=rng.choice(["float64", "float32"]), bias=rng.random() < 0.5, seed=rng.randint(0, 10**6)))
    return out


#: The props section's row measured beside plain inproc, in the same process on the same cases.
ISOLATED = "inproc isolated"
#: Rounds of the grouped pass when plain and isolated inproc are compared (fastest of each kept).
ISOLATION_ROUNDS = 3


def props_worker(backend: str, n: int, sizes: tuple[int, ...], target: str) -> dict[str, Any]:
    """In a fresh process, two passes over the same cases:

    - *grouped*: cases sorted by world size, so each world size's first example pays for starting
      its world (gloo: the worker pool) and the rest reuse it (``first_s``, ``per_example_s``);
    - *interleaved*: world sizes in the order a search draws them (``interleaved_per_example_s``):
      on gloo a world-size change may need a pool (tpsim keeps a few, least recently used).

    For ``inproc`` every case also runs isolated (``isolate=True``, what ``tpsim check`` does) right
    before or after its plain run, so both see the same cases under the same machine load; that row
    is returned under ``also[ISOLATED]``, its first example paying for starting the worker. The
    grouped pass then runs :data:`ISOLATION_ROUNDS` rounds (the order of the two flips each round):
    ``fastest_per_example_s`` is the mean over cases of each case's fastest round, which a busy
    machine disturbs far less than a single pass.
    """
    from tpsim.props import check_case
    from tpsim.target import resolve_target

    variant = resolve_target(target)[0]
    cases = sorted(_layer_cases(n + len(sizes), sizes), key=lambda c: c.world_size)
    modes = [(backend, False)] + ([(ISOLATED, True)] if backend == "inproc" else [])
    rounds = ISOLATION_ROUNDS if len(modes) > 1 else 1
    first: dict[str, dict[int, float]] = {label: {} for label, _ in modes}
    times: dict[str, list[list[float]]] = {label: [[] for _ in cases] for label, _ in modes}
    failures = 0
    for rnd in range(rounds):
        for i, case in enumerate(cases):
            for label, isolate in (modes if rnd % 2 == 0 else modes[::-1]):
                start = time.perf_counter()
                failures += bool(check_case(variant, case, backend=backend, timeout=60, isolate=isolate))
                elapsed = time.perf_counter() - start
                if rnd == 0 and case.world_size not in first[label]:
                    first[label][case.world_size] = elapsed
                times[label][i].append(elapsed)
    firsts = {i for i, case in enumerate(cases) if i == 0 or cases[i - 1].world_size != case.world_size}
    interleaved: dict[str, float | None] = {label: None for label, _ in modes}
    if len(sizes) > 1:
        spent = {label: 0.0 for label, _ in modes}
        for case in _layer_cases(n + len(sizes), sizes):
            for label, isolate in modes:
                start = time.perf_counter()
                failures += bool(check_case(variant, case, backend=backend, timeout=60, isolate=isolate))
                spent[label] += time.perf_counter() - start
        interleaved = {label: t / len(cases) for label, t in spent.items()}

    def row(label: str) -> dict[str, Any]:
        kept = [t for i, t in enumerate(times[label]) if i not in firsts]
        mean = sum(t[0] for t in kept) / max(len(kept), 1)
        fastest = sum(min(t) for t in kept) / max(len(kept), 1)
        return {"backend": label, "examples": len(kept), "per_example_s": mean,
                "examples_per_s": 1.0 / mean if mean else None, "first_s": first[label],
                "interleaved_per_example_s": interleaved[label], "failures": failures, "rounds": rounds,
                "fastest_per_example_s": fastest if rounds > 1 else None}

    out = row(backend)
    if len(modes) > 1:
        out["also"] = {label: row(label) for label, _ in modes[1:]}
    return out


def props(cfg: Config) -> dict[str, Any]:
    """Examples/s of ``check_case`` on tpsim's ColumnParallelLinear per backend (inproc also isolated,
    measured side by side with it); gloo start-up cost."""
    out = {}
    for backend in cfg.backends:
        sizes = ",".join(str(s) for s in cfg.prop_world_sizes)
        result = subprocess_json(["bench.props", backend, str(cfg.prop_examples), sizes,
                                  "tpsim.layers:ColumnParallelLinear"], 600)
        also = result.pop("also", {}) if result else {}
        out[backend] = result
        out.update(also)
    iso, plain = out.get(ISOLATED), out.get("inproc")
    overhead = None
    if iso and plain and iso.get("fastest_per_example_s") and plain.get("fastest_per_example_s"):
        # examples/s of isolated over plain, minus one (negative: isolation is slower)
        overhead = plain["fastest_per_example_s"] / iso["fastest_per_example_s"] - 1.0
    return {"variant": "tpsim.layers:ColumnParallelLinear", "backends": out, "isolation_examples_per_s_change": overhead}


# --- 3. mutants ----------------------------------------------------------------------------------


def mutants(cfg: Config) -> dict[str, Any]:
    """For each catalogued mutant: examples and seconds until the search reports its diagnosis."""
    try:
        from tpsim.mutants import CATALOG
        from tpsim.props.search import search
    except ImportError as err:
        return {"rows": [], "note": f"skipped: {err}"}
    rows = []
    for mutant in CATALOG[: cfg.mutant_limit]:
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # database=None: a replayed failure from an earlier run would make "examples to catch" 1
            report = search(mutant.variant, max_examples=cfg.mutant_examples, seed=0, database=None)
        seconds = time.perf_counter() - start
        found = [f for f in report.failures if f.diagnosis == mutant.diagnosis]
        first = getattr(found[0], "found_after", None) if found else None
        rows.append({"mutant": mutant.name, "diagnosis": mutant.diagnosis, "caught": bool(found),
                     "found_after": first, "examples": report.examples, "seconds": seconds,
                     "needs": getattr(mutant, "needs", ""),
                     "diagnoses": sorted({f.diagnosis for f in report.failures})})
    return {"rows": rows, "max_examples": cfg.mutant_examples, "catalog_size": len(CATALOG)}


# --- 4. lab-note MLP -----------------------------------------------------------------------------

#: The lab-note MLP configurations: (label, DenseMLP activation, ParallelMLP options).
LAB_CONFIGS = (
    ("gelu", "gelu", {}),
    ("swiglu, sequence parallel", "swiglu", {"sequence_parallel": True}),
)


def rank_lab_mlp(dense_state: dict[str, Any], hidden: int, intermediate: int, activation: str,
                 options: dict[str, Any], x: Any, g: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from tpsim.layers import DenseMLP, ParallelMLP

    with torch.device("meta"):
        dense = DenseMLP(hidden, intermediate, activation=activation, bias=True, dtype=torch.float32)
    dense = dense.to_empty(device="cpu")
    dense.load_state_dict(dense_state, assign=True)
    layer = ParallelMLP.from_dense(dense, group=dist.group.WORLD, **options)
    if options.get("sequence_parallel"):  # each rank takes and returns its shard of the sequence (dim -2)
        ws, r = dist.get_world_size(), dist.get_rank()
        x, g = x.chunk(ws, -2)[r], g.chunk(ws, -2)[r]
    xr = x.clone().requires_grad_(True)
    out = layer(xr)
    out.backward(g)
    return {"out": out.detach(), "dx": xr.grad, "fc2_bias": layer.fc2.bias.grad,
            "fc1_weight": layer.fc1.weight.grad, "fc2_weight": layer.fc2.weight.grad}


def _lab_expected(dense: Any, yd: Any, dx: Any, tp: int, r: int, gated: bool, sp: bool) -> list[tuple[str, Any]]:
    """Rank ``r``'s expected values from the dense run, in :func:`rank_lab_mlp`'s layout."""
    import torch

    w1 = dense.fc1.weight.grad
    if gated:  # the packed [gate; up] weight: shard r of each part
        gate, up = w1.chunk(2, 0)
        w1 = torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]], 0)
    else:
        w1 = w1.chunk(tp, 0)[r]
    out, dxr = (yd.chunk(tp, -2)[r], dx.chunk(tp, -2)[r]) if sp else (yd, dx)
    return [("out", out), ("dx", dxr), ("fc2_bias", dense.fc2.bias.grad), ("fc1_weight", w1),
            ("fc2_weight", dense.fc2.weight.grad.chunk(tp, 1)[r])]


def _labmlp_one(cfg: Config, label: str, activation: str, options: dict[str, Any]) -> dict[str, Any]:
    import torch

    import tpsim
    from tpsim.layers import DenseMLP
    from tpsim.props.tolerance import tolerance

    h, f, tp = cfg.lab_hidden, cfg.lab_intermediate, 2
    torch.manual_seed(0)
    build_start = time.perf_counter()
    dense = DenseMLP(h, f, activation=activation, bias=True, dtype=torch.float32)
    build_s = time.perf_counter() - build_start
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*cfg.lab_tokens, h, generator=gen)
    g = torch.randn(*cfg.lab_tokens, h, generator=gen)

    # the dense MLP's own forward+backward, warm (a second call), as a training step would see it
    for _ in range(2):
        dense.zero_grad(set_to_none=True)
        start = time.perf_counter()
        xd = x.clone().requires_grad_(True)
        yd = dense(xd)
        yd.backward(g)
        dense_s = time.perf_counter() - start

    start = time.perf_counter()
    state = {k: v.detach() for k, v in dense.state_dict().items()}
    values = tpsim.run(rank_lab_mlp, tp, args=(state, h, f, activation, options, x, g), timeout=300)
    world_s = time.perf_counter() - start
    # the check: every rank's output, input grad and grad shards against the dense run; magnitudes
    # are the dense values plus their mean (a float32 run of K = hidden + intermediate terms)
    ok = True
    k = h + f
    sp = bool(options.get("sequence_parallel"))
    for r, v in enumerate(values):
        for name, want in _lab_expected(dense, yd.detach(), xd.grad, tp, r, dense.gated, sp):
            got = v[name]
            if got.shape != want.shape:
                ok = False
                continue
            mag = want.abs().double() + want.abs().double().mean()
            tol = 2 * tolerance(torch.float32, mag, reduction_length=k, world_size=tp)
            ok &= bool(((got.double() - want.double()).abs() <= tol).all())
    check_s = time.perf_counter() - start
    return {"config": label, "activation": activation, "options": options, "hidden": h, "intermediate": f,
            "tp": tp, "tokens": list(cfg.lab_tokens), "dtype": "float32", "dense_init_s": build_s,
            "dense_fwd_bwd_s": dense_s, "world_fwd_bwd_s": world_s, "check_s": check_s, "equal": ok}


def labmlp(cfg: Config) -> dict[str, Any]:
    """The lab-note MLP checked on inproc (tp 2, float32) vs the dense MLP's own forward+backward:
    the plain gelu MLP and the gated (swiglu) one with sequence parallelism."""
    rows = [_labmlp_one(cfg, label, act, options) for label, act, options in LAB_CONFIGS]
    return {"rows": rows, "equal": all(r["equal"] for r in rows)}


# --- 5. faults -----------------------------------------------------------------------------------


def faults(cfg: Config) -> dict[str, Any]:
    """Detection latency: seconds from the run's start until the fault surfaces, per kind and backend."""
    try:
        from tpsim.faults import Corrupt, Crash, Delay, Drop, Mismatch
        from tpsim.props.faults import fault_detection
        from tpsim.props.linear.case import Case
        from tpsim.target import resolve_target
    except ImportError as err:
        return {"rows": [], "note": f"skipped: {err}"}
    variant = resolve_target("tpsim.layers:RowParallelLinear")[0]
    case = Case(world_size=2, in_features=8, out_features=4, batch_shape=(2,), bias=True, seed=0)
    timeout = 2.0
    plans = {
        "drop": Drop(1, 2),
        "crash": Crash(1, 2),
        "delay (past timeout)": Delay(1, 2, seconds=2 * timeout + 1),
        "corrupt (nan)": Corrupt(1, 1, how="nan", index=0),
        "mismatch (shape)": Mismatch(1, 2, what="shape"),
    }
    rows = []
    for backend in cfg.fault_backends:
        for kind, fault in plans.items():
            start = time.perf_counter()
            try:
                report = fault_detection(variant, case, [fault], backend=backend, timeout=timeout)
                ok, outcome, elapsed = report.ok, report.outcome, report.elapsed
            except AssertionError as err:  # FaultNotSurfaced: the guarantee did not hold
                rep = getattr(err, "report", None)
                ok, outcome, elapsed = False, getattr(rep, "outcome", "failed"), getattr(rep, "elapsed", None)
            rows.append({"backend": backend, "fault": kind, "detected": ok, "outcome": outcome,
                         "latency_s": elapsed, "wall_s": time.perf_counter() - start, "timeout_s": timeout})
    return {"rows": rows, "case": case.describe(), "variant": variant.name}


# --- 6. memory -----------------------------------------------------------------------------------


def memory_worker(mode: str, size: int, ws: int) -> dict[str, Any]:
    """In a fresh process: peak RSS (VmHWM) of a dense Linear fwd+bwd or an inproc world doing the
    same layer column-parallel, over the RSS right after imports."""
    import torch

    import tpsim  # noqa: F401  (imported in both modes so the baseline matches)
    from tpsim.layers import ColumnParallelLinear  # noqa: F401

    torch.set_num_threads(1)
    base = _rss_reset()
    if mode == "dense":
        layer = torch.nn.Linear(size, size)
        x = torch.randn(8, size, requires_grad=True)
        layer(x).sum().backward()
    else:
        tpsim.run(rank_memory, ws, args=(size,), timeout=120)
    return {"mode": mode, "size": size, "world_size": ws, "peak_mib": (_peak_kib() - base) / 1024.0}


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _rss_reset() -> int:
    """Reset the peak-RSS mark (Linux: ``5`` to ``/proc/self/clear_refs``; importing torch peaks
    above what the workload later uses) and return the current RSS in KiB."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError:
        pass
    return _status_kib("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak_kib() -> int:
    return _status_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def rank_memory(size: int) -> None:
    import torch
    import torch.distributed as dist

    from tpsim.layers import ColumnParallelLinear

    layer = ColumnParallelLinear(size, size, True, group=dist.group.WORLD, gather_output=True)
    x = torch.randn(8, size, requires_grad=True)
    layer(x).sum().backward()


def memory(cfg: Config) -> dict[str, Any]:
    rows = [subprocess_json(["bench.memory", "dense", str(cfg.memory_size), "1"], 300)]
    for ws in cfg.memory_world_sizes:
        rows.append(subprocess_json(["bench.memory", "inproc", str(cfg.memory_size), str(ws)], 300))
    return {"rows": rows, "size": cfg.memory_size}


# --- 7. DTensor ----------------------------------------------------------------------------------


def dtensor(cfg: Config) -> dict[str, Any]:
    """Per-example time of the DTensor adapters vs tpsim's own layer, inproc vs gloo (warm pools)."""
    out = {}
    targets = {
        "DTensor ColwiseParallel": "examples/dtensor_colwise.py:ColwiseParallel",
        "DTensor RowwiseParallel": "examples/dtensor_rowwise.py:RowwiseParallel",
        "tpsim ColumnParallelLinear": "tpsim.layers:ColumnParallelLinear",
    }
    if cfg is QUICK:  # one target proves the path; the full run measures all three
        targets = dict(list(targets.items())[:1])
    for label, target in targets.items():
        for backend in cfg.backends:
            result = subprocess_json(["bench.props", backend, str(cfg.dtensor_examples), "2", target], 600)
            out.setdefault(label, {})[backend] = result
    return {"rows": out}


# --- 8. what a user waits for: tpsim check end to end -----------------------------------------------

#: The ``tpsim check`` commands measured end to end: label -> (what it checks, its arguments).
CHECK_COMMANDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ws 1-4": ("tpsim's column layer, 100 examples, world sizes 1-4 (divisible and not)",
               ("tpsim.layers:ColumnParallelLinear", "--seed", "0", "--world-sizes", "1,2,3,4")),
    "default": ("tpsim's column layer, the default command (100 examples, world sizes 1,2,3,4,8)",
                ("tpsim.layers:ColumnParallelLinear", "--seed", "0")),
    "megatron": ("the Megatron-core preset, 10 examples, world sizes 1,2,4",
                 ("megatron.core.tensor_parallel", "--seed", "0", "--max-examples", "10", "--world-sizes", "1,2,4")),
}
#: The backends each command runs on: label -> extra arguments. ``inproc`` is what ``tpsim check``
#: runs by default (the worlds in an isolated worker process).
CHECK_BACKENDS: dict[str, tuple[str, ...]] = {
    "inproc": ("--backend", "inproc"),
    "inproc, not isolated": ("--backend", "inproc", "--no-isolate"),
    "gloo": ("--backend", "gloo"),
}
#: Which backends a command runs on (the not-isolated row only where it compares something).
CHECK_BACKENDS_OF = {"ws 1-4": ("inproc", "inproc, not isolated", "gloo"),
                     "default": ("inproc", "inproc, not isolated", "gloo"),
                     "megatron": ("inproc", "gloo")}
#: Seconds one ``tpsim check`` may take before it is killed and recorded as over the limit.
CHECK_LIMIT_S = 900.0


def _one_check(args: tuple[str, ...], cases_dir: str) -> dict[str, Any] | None:
    """``python -m tpsim check ARGS --report json`` in a fresh process: its reported seconds and the
    process's wall time (interpreter, imports and exit included); None past :data:`CHECK_LIMIT_S`."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "tpsim", "check", *args, "--report", "json", "--cases-dir", cases_dir]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=CHECK_LIMIT_S)
    except subprocess.TimeoutExpired:
        return None
    wall = time.perf_counter() - start
    try:
        doc = json.loads(done.stdout)
    except json.JSONDecodeError as err:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode} without a JSON report:\n{done.stderr[-2000:]}") from err
    replaced = doc.get("pool_replacements") or {}
    return {"check_s": doc["seconds"], "wall_s": wall, "examples": doc["examples"], "passed": doc["passed"],
            "exit": done.returncode, "pool_replacements": replaced.get("count"),
            "pool_replacements_by_reason": replaced.get("by_reason", {})}


def checks(cfg: Config) -> dict[str, Any]:
    """``tpsim check`` end to end, each command on each backend in a fresh process, interleaved (every
    backend in turn, then the next round), the fastest round kept."""
    import tempfile

    rows: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    commands = [c for c in cfg.check_commands if c in CHECK_COMMANDS]
    if "megatron" in commands:
        try:
            import megatron.core  # noqa: F401
        except ImportError as err:
            commands.remove("megatron")
            notes.append(f"the Megatron-core rows were not run: {err}")
    with tempfile.TemporaryDirectory(prefix="tpsim-bench-cases-") as cases:
        for _round in range(cfg.check_rounds):
            for name in commands:
                what, args = CHECK_COMMANDS[name]
                for backend in CHECK_BACKENDS_OF[name]:
                    if CHECK_BACKENDS[backend][1] not in cfg.backends:
                        continue  # e.g. no gloo in a quick run
                    key = f"{name} | {backend}"
                    row = rows.setdefault(key, {"command": name, "what": what, "backend": backend,
                                                "args": list(args + CHECK_BACKENDS[backend] + cfg.check_extra),
                                                "command_line": " ".join(("tpsim", "check", *args, *cfg.check_extra)),
                                                "samples": []})
                    if row["samples"] and row["samples"][-1] is None:
                        continue  # over the limit once: not run again
                    row["samples"].append(_one_check(args + CHECK_BACKENDS[backend] + cfg.check_extra, cases))
    for row in rows.values():
        done = [s for s in row["samples"] if s is not None]
        best = min(done, key=lambda s: s["check_s"]) if done else None
        row.update({k: (best or {}).get(k) for k in ("check_s", "wall_s", "examples", "passed", "exit",
                                                     "pool_replacements", "pool_replacements_by_reason")})
        row["check_s_samples"] = [None if s is None else s["check_s"] for s in row["samples"]]
        row["pool_replacements_total"] = sum((s or {}).get("pool_replacements") or 0 for s in row["samples"])
    return {"rows": list(rows.values()), "rounds": cfg.check_rounds, "extra": list(cfg.check_extra),
            "notes": notes}


# --- 8b. overhead: inproc's cost per collective per rank, beside its floor -------------------------------


def rank_timed_all_reduces(calls: int) -> tuple[float, float, float, float]:
    """``calls`` all_reduces of a one-element tensor after a first one (every rank has arrived once it
    returns): the wall and process CPU clocks before and after them."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        dist.all_reduce(t)
    return w0, c0, time.perf_counter(), time.process_time()


def inproc_collective_cost(ws: int, calls: int) -> tuple[float, float]:
    """Microseconds of wall and process CPU time per all_reduce per rank on an inproc world of ``ws``
    ranks: from the moment the first rank leaves a first all_reduce (all have arrived) until the last
    rank leaves its last, over ``calls`` all_reduces of every rank. Thread start-up and exit fall
    outside it."""
    import tpsim

    marks = tpsim.run(rank_timed_all_reduces, ws, args=(calls,))
    n = calls * ws
    wall = (max(m[2] for m in marks) - min(m[0] for m in marks)) / n * 1e6
    cpu = (max(m[3] for m in marks) - min(m[1] for m in marks)) / n * 1e6
    return wall, cpu


#: The backend name of :func:`null_world`'s process group.
NULL_BACKEND = "tpsim_bench_null"


def _null_group_class() -> type:
    import torch.distributed as dist

    class Done(dist.Work):
        def wait(self, timeout: Any = None) -> bool:
            return True

    class NullGroup(dist.ProcessGroup):
        """A process group whose collectives cost nothing: one completed handle, handed back at once."""

        def __init__(self, rank: int, size: int) -> None:
            super().__init__(rank, size)
            self._done = Done()

        def allreduce(self, tensors: Any, opts: Any = None) -> Any:
            return self._done

        def getBackendName(self) -> str:
            return NULL_BACKEND

    return NullGroup


def null_world() -> Any:
    """Make a one-rank world of a process group that does nothing the default group of this process
    (torch's own registry: no inproc world runs here) and return that group. ``dist.all_reduce`` on it
    costs torch's wrapper and two trivial Python calls, and nothing of any backend."""
    import torch.distributed as dist

    if NULL_BACKEND.upper() not in dist.Backend._plugins:
        group = _null_group_class()
        dist.Backend.register_backend(NULL_BACKEND, lambda opts, _=None: group(opts.group_rank, opts.group_size),
                                      extended_api=True, devices=["cpu"])
    dist.init_process_group(NULL_BACKEND, store=dist.HashStore(), rank=0, world_size=1)
    return dist.distributed_c10d._get_default_group()


def handoff_ring(ws: int, rounds: int, placed: bool = False, call: str = "") -> tuple[float, float]:
    """The floor of any design that runs each rank in a thread of its own, one at a time: ``ws``
    Python threads passing a token round a ring ``rounds`` times with plain locks (one lock
    release and one acquire per hand-off, nothing else); microseconds of wall and process CPU time
    per hand-off. Every rank of a blocking collective hands on its turn once, so no such backend's
    collective costs less per rank.

    ``placed``: every thread placed as inproc places its rank threads (one CPU for all,
    ``SCHED_BATCH``: :func:`tpsim.comm.inproc._pin`), which makes a hand-off cheaper than between
    threads the OS places; the floor is the cheaper of the two rings.

    ``call``: between taking the token and passing it on, each thread calls ``dist.all_reduce`` on
    a one-element tensor of its own (``"wrapped"``) or the default group's ``allreduce`` as that
    calls it (``"direct"``), on :func:`null_world`'s group: the difference is torch's wrapper as a
    rank among ``ws`` threads taking turns runs it, which costs more than in a loop of one thread
    (colder caches: :func:`overhead_worker` measures both)."""
    import threading

    import torch
    import torch.distributed as dist

    from tpsim.comm import inproc

    cpu = inproc._choose_cpu() if placed else None
    locks = [threading.Lock() for _ in range(ws)]
    for lock in locks:
        lock.acquire()
    pg = dist.distributed_c10d._get_default_group() if call else None

    def turn(i: int) -> None:
        if placed:
            inproc._pin(cpu)
        mine, nxt = locks[i], locks[(i + 1) % ws]
        t = torch.ones(1)
        if call == "wrapped":
            for _ in range(rounds):
                mine.acquire()
                dist.all_reduce(t)
                nxt.release()
        elif call == "direct":
            opts = dist.AllreduceOptions()  # what dist.all_reduce(t) builds and passes
            opts.reduceOp = dist.ReduceOp.SUM
            opts.asyncOp = False
            for _ in range(rounds):
                mine.acquire()
                pg.allreduce([t], opts).wait()  # type: ignore[union-attr]
                nxt.release()
        else:
            for _ in range(rounds):
                mine.acquire()
                nxt.release()

    threads = [threading.Thread(target=turn, args=(i,), daemon=True) for i in range(ws)]
    for t in threads:
        t.start()
    t0, c0 = time.perf_counter(), time.process_time()
    locks[0].release()
    for t in threads:
        t.join()
    n = ws * rounds
    return (time.perf_counter() - t0) / n * 1e6, (time.process_time() - c0) / n * 1e6


def wrapper_cost(calls: int, rounds: int = 40) -> float:
    """Microseconds per call that torch's ``dist.all_reduce`` adds to the default process group's own
    ``allreduce`` as it calls it (its argument checks, group lookup, options and logging wrapper) on
    the calling thread's current one-rank world, in a loop of one thread: the fastest batch of
    ``calls`` of each, interleaved over ``rounds``, one less the other, in this thread's CPU time (a
    batch the machine preempts is not slower for it). Every backend behind ``torch.distributed`` pays it."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    pg = dist.distributed_c10d._get_default_group()
    opts = dist.AllreduceOptions()  # what dist.all_reduce(t) builds and passes
    opts.reduceOp = dist.ReduceOp.SUM
    opts.asyncOp = False
    clock = time.thread_time
    wrapped = direct = float("inf")
    for _ in range(rounds):
        t0 = clock()
        for _ in range(calls):
            dist.all_reduce(t)
        t1 = clock()
        for _ in range(calls):
            pg.allreduce([t], opts).wait()
        t2 = clock()
        wrapped, direct = min(wrapped, t1 - t0), min(direct, t2 - t1)
    return (wrapped - direct) / calls * 1e6


def overhead_worker(sizes: tuple[int, ...], calls: int, repeats: int) -> dict[str, Any]:
    """inproc's cost of one collective per rank, with a one-element tensor, at each world size in
    ``sizes`` (:func:`inproc_collective_cost`; ``calls`` at world size 32, scaled by 32 / world size,
    at least 50), beside its floor measured in the same rounds: a thread hand-off (:func:`handoff_ring`,
    the cheaper of the plain and the placed ring) plus torch's own ``dist.all_reduce`` wrapper as a rank
    among as many threads taking turns runs it (the placed ring calling it, less the same ring calling
    the group directly, on :func:`null_world`'s group); the fastest of ``repeats`` rounds of each. The
    wrapper in a loop of one thread (:func:`wrapper_cost`) is reported beside it, on that world and on
    an inproc world of one rank (where tpsim's per-thread routing of the registry adds to it)."""
    import torch
    import torch.distributed as dist

    import tpsim

    torch.set_num_threads(1)
    rows = []
    for ws in sizes:
        n = max(50, calls * 32 // ws)
        inproc_collective_cost(ws, 2)  # warm
        samples: dict[str, list[tuple[float, float]]] = {k: [] for k in ("inproc", "plain", "placed", "wrapped",
                                                                          "direct")}
        for _ in range(repeats):
            samples["inproc"].append(inproc_collective_cost(ws, n))
            samples["plain"].append(handoff_ring(ws, n))
            samples["placed"].append(handoff_ring(ws, n, placed=True))
            null_world()
            try:
                samples["wrapped"].append(handoff_ring(ws, n, placed=True, call="wrapped"))
                samples["direct"].append(handoff_ring(ws, n, placed=True, call="direct"))
            finally:
                dist.destroy_process_group()
        best = {k: (min(w for w, _ in v), min(c for _, c in v)) for k, v in samples.items()}
        wrapper = max(0.0, best["wrapped"][1] - best["direct"][1])  # CPU time: a preempted round is not slower
        handoff = min(best["plain"][0], best["placed"][0])
        handoff_cpu = min(best["plain"][1], best["placed"][1])
        row = {"world_size": ws, "calls": n, "wall_us": best["inproc"][0], "cpu_us": best["inproc"][1],
               "plain_ring_us": best["plain"][0], "placed_ring_us": best["placed"][0], "handoff_floor_us": handoff,
               "handoff_floor_cpu_us": handoff_cpu, "torch_wrapper_us": wrapper,
               "floor_us": handoff + wrapper, "floor_cpu_us": handoff_cpu + wrapper}
        row["ratio"] = row["wall_us"] / row["floor_us"] if row["floor_us"] > 0 else None
        row["cpu_ratio"] = row["cpu_us"] / row["floor_cpu_us"] if row["floor_cpu_us"] > 0 else None
        row["samples"] = {k: [list(x) for x in v] for k, v in samples.items()}  # (wall us, CPU us) each
        rows.append(row)
    null_world()
    try:
        hot = wrapper_cost(200)
    finally:
        dist.destroy_process_group()
    (routed,) = tpsim.run(wrapper_cost, 1, args=(200,))
    return {"repeats": repeats, "rows": rows, "torch_wrapper_hot_us": hot, "torch_wrapper_inproc_us": routed}


def overhead(cfg: Config) -> dict[str, Any]:
    """The overhead section: :func:`overhead_worker` in a fresh process (``python -m bench.overhead``)."""
    result = subprocess_json(["bench.overhead", ",".join(map(str, cfg.overhead_world_sizes)), str(cfg.overhead_calls),
                              str(cfg.overhead_repeats)], 900)
    if result is None:
        return {"rows": [], "skipped": "ran past 900 s"}
    result["load"] = _load_now()
    return result


# --- 9. scale: a whole check vs the dense twin's forward+backward, by size ----------------------------

#: The lab note's MLP proportion: ffn = hidden * 11008 / 4096 (rounded to an even size: tp 2 divides it).
LAB_FFN_PER_HIDDEN = 11008 / 4096
#: Every scale case: tp 2, float32, seed 0. Tokens of the MLP and embedding cases, and of the
#: cross-entropy's logits (a realistic batch of rows over the vocabulary); the embedding's width.
SCALE_TOKENS = (2, 8)
SCALE_CE_TOKENS = (2, 256)
SCALE_EMBEDDING_DIM = 4096
#: The families measured: label -> what the size is.
SCALE_FAMILIES = {"mlp": "hidden", "embedding": "vocab", "cross-entropy": "vocab"}


def _scale_case(family: str, size: int, quick: bool) -> tuple[Any, Any, Any, Callable[[], None], Callable[[], None]]:
    """``(family object, variant, case, dense, floor)`` for one scale measurement; ``dense()`` runs the
    dense twin's forward+backward once (float32, the case's shapes, warm parameters); ``floor()`` does,
    in plain torch, the least any check of the case does besides running the layer itself: draw the
    case's random values (float32 normal draws, as the harness does) and run the dense layer once in
    float64 on them (the oracle: the values converted, a forward and a backward)."""
    import torch
    import torch.nn.functional as F

    from tpsim import builtin_variants as bv

    f64 = torch.float64
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    if family == "mlp":
        from tpsim.layers import DenseMLP
        from tpsim.props.module.case import ModuleCase
        from tpsim.props.module.family import MODULE

        ffn = 2 * round(size * LAB_FFN_PER_HIDDEN / 2)
        case = ModuleCase(world_size=2, sizes=(size, ffn), batch_shape=SCALE_TOKENS, dtype="float32", seed=0)
        mlp = DenseMLP(size, ffn, activation="swiglu", bias=True, dtype=torch.float32)
        mlp64 = DenseMLP(size, ffn, activation="swiglu", bias=True, dtype=f64)
        x, g = torch.randn(*SCALE_TOKENS, size), torch.randn(*SCALE_TOKENS, size)

        def dense() -> None:
            mlp.zero_grad(set_to_none=True)
            mlp(x.clone().requires_grad_(True)).backward(g)

        def floor() -> None:
            for p in mlp64.parameters():
                p.data = torch.randn(*p.shape, generator=gen, dtype=torch.float32).to(f64)
                p.grad = None
            mlp64(x.to(f64).requires_grad_(True)).backward(g.to(f64))

        # initialise=False: the harness loads every parameter (as tests/test_modules_labscale.py does)
        return MODULE, bv.mlp_variant("swiglu", initialise=False), case, dense, floor
    from tpsim.props.vocab.case import CrossEntropyCase, EmbeddingCase
    from tpsim.props.vocab.family import CROSS_ENTROPY, EMBEDDING

    if family == "embedding":
        dim = 16 if quick else SCALE_EMBEDDING_DIM
        emb = torch.nn.Embedding(size, dim)
        ids, g = torch.randint(0, size, SCALE_TOKENS), torch.randn(*SCALE_TOKENS, dim)

        def dense() -> None:
            emb.zero_grad(set_to_none=True)
            emb(ids).backward(g)

        def floor() -> None:
            w = torch.randn(size, dim, generator=gen, dtype=torch.float32).to(f64).requires_grad_(True)
            F.embedding(ids, w).backward(g.to(f64))

        case = EmbeddingCase(world_size=2, vocab_size=size, embedding_dim=dim, batch_shape=SCALE_TOKENS,
                             dtype="float32", seed=0)
        return EMBEDDING, bv.vocab_embedding, case, dense, floor
    tokens = SCALE_TOKENS if quick else SCALE_CE_TOKENS
    logits, target, g = torch.randn(*tokens, size), torch.randint(0, size, tokens), torch.rand(tokens)

    def dense() -> None:
        leaf = logits.clone().requires_grad_(True)
        F.cross_entropy(leaf.reshape(-1, size), target.reshape(-1), reduction="none").reshape(tokens).backward(g)

    def floor() -> None:
        leaf = torch.randn(*tokens, size, generator=gen, dtype=torch.float32).to(f64).requires_grad_(True)
        F.cross_entropy(leaf.reshape(-1, size), target.reshape(-1), reduction="none").reshape(tokens).backward(
            g.to(f64))

    case = CrossEntropyCase(world_size=2, vocab_size=size, batch_shape=tokens, dtype="float32", seed=0)
    return CROSS_ENTROPY, bv.vocab_cross_entropy, case, dense, floor


def scale_worker(family: str, size: int, rounds: int, quick: bool = False) -> dict[str, Any]:
    """In a fresh process: the family's whole check of one case (``check_case`` on inproc, not isolated:
    the reference run, the world, every property) and its dense twin's forward+backward, side by side:
    ``rounds`` rounds of (dense twice, check once), after one small warm-up check (imports, first
    use of the rules). Wall time and this process's CPU time (every thread); the fastest of each kept."""
    import torch

    fam, variant, case, dense, floor = _scale_case(family, size, quick)
    small = {"mlp": (16, 44), "embedding": 32, "cross-entropy": 32}[family]
    warm = _scale_case(family, small[0] if isinstance(small, tuple) else small, True)
    warm[0].check_case(warm[1], warm[2], timeout=600)

    def timed(fn: Callable[[], Any], times: int) -> tuple[float, float, Any]:
        walls, cpus, out = [], [], None
        for _ in range(times):
            w0, c0 = time.perf_counter(), time.process_time()
            out = fn()
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
        return min(walls), min(cpus), out

    rows = []
    for _ in range(rounds):
        # dense twice: the first call of a round pays for fresh grad buffers, as a training step does
        d_wall, d_cpu, _ = timed(dense, 2)
        f_wall, f_cpu, _ = timed(floor, 2)
        c_wall, c_cpu, failures = timed(lambda: fam.check_case(variant, case, timeout=900), 1)
        rows.append({"dense_s": d_wall, "dense_cpu_s": d_cpu, "floor_s": f_wall, "floor_cpu_s": f_cpu,
                     "check_s": c_wall, "check_cpu_s": c_cpu, "failures": len(failures)})
    best = {k: min(r[k] for r in rows) for k in ("dense_s", "dense_cpu_s", "floor_s", "floor_cpu_s", "check_s",
                                                   "check_cpu_s")}
    return {"family": family, "size": size, "case": case.describe(), "variant": variant.name,
            "threads": torch.get_num_threads(), "rounds": rows, **best,
            "ratio": best["check_s"] / best["dense_s"], "cpu_ratio": best["check_cpu_s"] / best["dense_cpu_s"],
            # the least a check can cost, against the dense layer: drawing the case and the float64
            # oracle (floor) plus running the layer once (about one dense forward+backward)
            "floor_ratio": (best["floor_s"] + best["dense_s"]) / best["dense_s"],
            "round_ratios": [r["check_s"] / r["dense_s"] for r in rows],
            "passed": all(r["failures"] == 0 for r in rows)}


def scale(cfg: Config) -> dict[str, Any]:
    """Each family's whole check against its dense twin's forward+backward at several sizes, each size
    in a fresh process (:func:`scale_worker`); a size past its time limit skips the larger ones."""
    quick = cfg is QUICK
    out: dict[str, list[dict[str, Any]]] = {}
    skipped: dict[str, str] = {}
    for family, what in SCALE_FAMILIES.items():
        sizes = cfg.scale_hidden if what == "hidden" else cfg.scale_vocab
        out[family] = []
        for size in sizes:
            row = subprocess_json(["bench.scale", family, str(size), str(cfg.scale_rounds)] + (["quick"] if quick else []),
                                  300.0 * cfg.scale_rounds + 120.0)
            if row is None:
                skipped[family] = f"{what} {size} ran past its time limit; larger sizes skipped"
                break
            out[family].append(row)
    return {"families": out, "skipped": skipped, "rounds": cfg.scale_rounds, "tokens": list(SCALE_TOKENS),
            "ce_tokens": list(SCALE_TOKENS if quick else SCALE_CE_TOKENS),
            "embedding_dim": 16 if quick else SCALE_EMBEDDING_DIM, "load": _load_now()}


def _load_now() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return -1.0


SECTIONS = {"step": step, "props": props, "mutants": mutants, "labmlp": labmlp, "faults": faults,
            "memory": memory, "dtensor": dtensor, "checks": checks, "overhead": overhead, "scale": scale}
