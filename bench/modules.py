"""``python -m bench.modules PAIR HIDDEN FFN ROUNDS``: a module under a DTensor plan against the same module
built from tpsim's own layers, per example, side by side in a fresh process; prints one JSON line. See
:func:`modules_worker` and the ``modules`` section of :mod:`bench`."""

from __future__ import annotations

import cProfile
import json
import pstats
import sys
import time
import warnings
from typing import Any

#: The pairs: label -> (the plan target and its plan, tpsim's own module (target, resolve options)).
PAIRS: dict[str, tuple[tuple[str, dict[str, Any]], tuple[str, dict[str, Any]]]] = {
    "gated MLP": (("examples/plan_mlp.py:GatedMLP", {"plan": "examples/plan_mlp.py:PLAN"}),
                  ("tpsim.layers:mlp_swiglu", {})),
    "decoder block": (("bench/blocks.py:PlanBlock", {"plan": "bench/blocks.py:BLOCK_PLAN"}),
                      ("bench/blocks.py:OwnBlock", {"kind": "module"})),
}

#: Where a DTensor plan's example goes, by the code that runs (see :func:`phases`).
PHASES = ("plan application", "DTensor dispatch (torch)", "dense twin", "magnitude run", "float64 reference",
          "the module's own arithmetic", "judging", "tpsim's module-state watch", "tpsim's worlds", "the rest")

#: Code only DTensor runs here (its sharding propagation on fake tensors, whose mode records a stack
#: with ``traceback``, its pytrees, functional collectives, device meshes and op overloads).
DTENSOR_CODE = ("torch/distributed/tensor/", "torch/_subclasses/", "torch/utils/_pytree", "torch/_library/",
                "torch/distributed/_functional_collectives", "torch/_opaque_base", "torch/_ops.py", "torch/_dynamo/",
                "torch/distributed/_pycute", "torch/distributed/_mesh_layout", "torch/distributed/device_mesh",
                "/traceback.py", "/linecache.py", "torch/utils/_python_dispatch", "torch/_prims_common",
                "torch/_functorch/", "torch/utils/_config_module")


def _variant(target: str, options: dict[str, Any]) -> Any:
    from tpsim.target import resolve_target

    if target == "tpsim.layers:mlp_swiglu":
        from tpsim import builtin_variants as bv

        return bv.mlp_swiglu
    return resolve_target(target, **options)[0]


def phases(stats: pstats.Stats) -> dict[str, float]:
    """Seconds of one profile (every thread's, merged) by phase: the inclusive time of tpsim's plan
    application (``apply_plan``), of the dense twin (``twin_run``), of the magnitude run
    (``_magnitudes``), of the float64 reference's own training (``reference_main`` less the two), and of
    the judging (``judge``); the exclusive time of :data:`DTENSOR_CODE` outside the plan application:
    DTensor's dispatch; of tpsim's module-state watch (:mod:`tpsim.comm.modstate`) and of its worlds
    (the rest of ``tpsim.comm``); of torch's kernels (``torch._C``) elsewhere; the rest. Lock waits (a thread waiting for another)
    are left out."""
    raw = stats.stats  # type: ignore[attr-defined]

    def inclusive(fragment: str) -> float:
        return sum(v[3] for k, v in raw.items() if fragment in f"{k[0]}:{k[2]}")

    waits = sum(v[2] for k, v in raw.items() if k[2] in ("<method 'acquire' of '_thread.lock' objects>",
                                                         "<method 'wait' of '_thread.lock' objects>"))
    total = sum(v[2] for v in raw.values()) - waits
    plan = inclusive("module/plans.py:apply_plan")
    twin = inclusive("module/twin.py:twin_run")
    mag = inclusive("module/world.py:_magnitudes")
    ref = max(0.0, inclusive("module/world.py:reference_main") - twin - mag)
    judge = inclusive("props/judging.py:judge")
    dtensor = sum(v[2] for k, v in raw.items() if any(s in k[0] for s in DTENSOR_CODE))
    kernels = sum(v[2] for k, v in raw.items() if k[0] == "~" and "torch._C" in k[2])
    watch = sum(v[2] for k, v in raw.items() if k[0].endswith("tpsim/comm/modstate.py"))
    worlds = sum(v[2] for k, v in raw.items() if "tpsim/comm/" in k[0] and not k[0].endswith("modstate.py")
                 or k[2] == "<method 'release' of '_thread.lock' objects>")
    # the plan application's own DTensor work is counted with it
    dtensor = max(0.0, dtensor - plan)
    out = {"plan application": plan, "DTensor dispatch (torch)": dtensor, "dense twin": twin, "magnitude run": mag,
           "float64 reference": ref, "judging": judge, "tpsim's module-state watch": watch, "tpsim's worlds": worlds}
    named = sum(out.values())
    out["the module's own arithmetic"] = max(0.0, min(kernels, total - named))
    out["the rest"] = max(0.0, total - named - out["the module's own arithmetic"])
    return out


def _profiled(variant: Any, case: Any, n: int) -> dict[str, float]:
    """:func:`phases` of ``n`` checks of ``case``, every rank thread profiled too."""
    from tpsim.comm import inproc
    from tpsim.props.module.family import MODULE

    profiles: list[cProfile.Profile] = []
    original = inproc._rank_main

    def rank_main(*args: Any, **kwargs: Any) -> Any:
        p = cProfile.Profile()
        p.enable()
        try:
            return original(*args, **kwargs)
        finally:
            p.disable()
            profiles.append(p)

    inproc._rank_main = rank_main
    main = cProfile.Profile()
    try:
        main.enable()
        for _ in range(n):
            MODULE.check_case(variant, case, timeout=600)
        main.disable()
    finally:
        inproc._rank_main = original
    stats = pstats.Stats(main)
    for p in profiles:
        stats.add(p)
    return {k: v / n for k, v in phases(stats).items()}


def modules_worker(pair: str, hidden: int, ffn: int, rounds: int, profile: bool = False) -> dict[str, Any]:
    """The pair's two variants checked on the same case (world size 2, float32, seed 0, inproc, not
    isolated) ``rounds`` times, interleaved (plan, own, own, plan, ...), after one warm-up check of each;
    wall and process CPU seconds per example, the fastest of each kept; ``profile``: where the plan's
    examples go (:func:`phases`, from 3 more examples of each, profiled)."""
    import torch

    from tpsim.props.module.case import ModuleCase
    from tpsim.props.module.family import MODULE

    (plan_t, plan_o), (own_t, own_o) = PAIRS[pair]
    plan, own = _variant(plan_t, plan_o), _variant(own_t, own_o)
    case = ModuleCase(world_size=2, sizes=(hidden, ffn), batch_shape=(2, 8), dtype="float32", seed=0)
    failures = {}
    for label, v in (("plan", plan), ("own", own)):
        failures[label] = [f.describe() for f in MODULE.check_case(v, case, timeout=600)]
    samples: dict[str, list[tuple[float, float]]] = {"plan": [], "own": []}
    for r in range(rounds):
        for label, v in ((("plan", plan), ("own", own)) if r % 2 == 0 else (("own", own), ("plan", plan))):
            w0, c0 = time.perf_counter(), time.process_time()
            MODULE.check_case(v, case, timeout=600)
            samples[label].append((time.perf_counter() - w0, time.process_time() - c0))
    best = {k: (min(w for w, _ in s), min(c for _, c in s)) for k, s in samples.items()}
    out = {"pair": pair, "hidden": hidden, "ffn": ffn, "case": case.describe(), "plan": plan.name, "own": own.name,
           "threads": torch.get_num_threads(), "rounds": rounds,
           "plan_s": best["plan"][0], "own_s": best["own"][0], "plan_cpu_s": best["plan"][1],
           "own_cpu_s": best["own"][1], "ratio": best["plan"][0] / best["own"][0],
           "cpu_ratio": best["plan"][1] / best["own"][1],
           "samples": {k: [list(x) for x in s] for k, s in samples.items()},
           "passed": not failures["plan"] and not failures["own"], "failures": failures}
    if profile:
        out["profile"] = {"plan": _profiled(plan, case, 3), "own": _profiled(own, case, 3)}
    return out


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    pair, hidden, ffn, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(modules_worker(pair, hidden, ffn, rounds, profile="profile" in sys.argv[5:])))
