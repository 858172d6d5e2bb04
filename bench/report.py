"""Render a benchmark result (the dict :mod:`bench.__main__` builds) as markdown and PNG plots."""

from __future__ import annotations

import os
import platform
from typing import Any


def machine() -> dict[str, Any]:
    """CPU model, cores, Python and torch versions: every table and figure names them."""
    import torch

    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform()}


def machine_line(m: dict[str, Any]) -> str:
    return f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, Python {m['python']}"


def _s(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _secs(v: Any) -> str:
    return "—" if v is None else f"{_s(v)} s"


def _ratio(a: Any, b: Any) -> str:
    return "—" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def _at(sec: dict[str, Any], backend: str, ws: Any) -> Any:
    """``sec[backend][ws]``; JSON turned the world-size keys into strings."""
    series = sec.get(backend) or {}
    return series.get(ws, series.get(str(ws)))


def headline(result: dict[str, Any]) -> list[dict[str, Any]]:
    """inproc/floor, inproc/compute and threaded/inproc at the headline world sizes."""
    step = result.get("step")
    if not step:
        return []
    sec = step["seconds"]
    rows = []
    for ws in step["headline"]:
        f, c, i, t = (_at(sec, b, ws) for b in ("floor", "compute", "inproc", "threaded"))
        rows.append({"world_size": ws, "floor_s": f, "compute_s": c, "inproc_s": i, "threaded_s": t,
                     "inproc_over_floor": None if i is None or not f else i / f,
                     "inproc_over_compute": None if i is None or not c else i / c,
                     "threaded_over_inproc": None if t is None or not i else t / i})
    return rows


def worst_over_floor(result: dict[str, Any], low: int = 2, high: int = 128) -> tuple[int, float] | None:
    """The world size in [low, high] where inproc is furthest from the floor, and that ratio."""
    step = result.get("step")
    if not step:
        return None
    ratios = []
    for ws in step["sizes"]:
        f, i = _at(step["seconds"], "floor", ws), _at(step["seconds"], "inproc", ws)
        if low <= int(ws) <= high and f and i:
            ratios.append((i / f, int(ws)))
    if not ratios:
        return None
    ratio, ws = max(ratios)
    return ws, ratio


#: The examples a search checks per variant by default (tpsim.props.search.DEFAULT_MAX_EXAMPLES).
WAIT_EXAMPLES = 100


def _check_rows(result: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """The checks section's rows by (command, backend)."""
    rows = ((result.get("checks") or {}).get("rows")) or []
    return {(r["command"], r["backend"]): r for r in rows}


def waits(result: dict[str, Any]) -> str:
    """One plain paragraph: how long the default command took on each backend (the checks section),
    else an estimate from the props section (a result from before the checks section)."""
    rows = _check_rows(result)
    i, g = rows.get(("default", "inproc")), rows.get(("default", "gloo"))
    if i and g and i.get("check_s") is not None and g.get("check_s") is not None:
        replaced = g.get("pool_replacements_total")
        return (f"**What you wait for:** `tpsim check tpsim.layers:ColumnParallelLinear --seed 0` (the default: "
                f"{i['examples']} generated examples at world sizes 1, 2, 3, 4 and 8) took {_s(i['check_s'], 2)} s on "
                f"inproc and {_s(g['check_s'], 2)} s with `--backend gloo` ({_s(i['wall_s'], 2)} s and "
                f"{_s(g['wall_s'], 2)} s for the whole command, Python's start-up and imports included; gloo "
                f"replaced {replaced} worker pool{'' if replaced == 1 else 's'}). Shrinking a failure to its minimal "
                "case adds a few dozen examples.")
    backends = ((result.get("props") or {}).get("backends") or {})
    totals, starts, sizes = [], [], ""
    for backend in ("inproc", "gloo"):
        r = backends.get(backend)
        if not r or not r.get("per_example_s"):
            continue
        first = r.get("first_s") or {}
        start = sum(first.values())
        totals.append(f"about {_s(WAIT_EXAMPLES * r['per_example_s'] + start, 2)} s on {backend}")
        starts.append(f"{_s(start, 2)} s")
        sizes = ", ".join(str(k) for k in first)
    if not totals:
        return ""
    return (f"**What you wait for:** checking a layer on {WAIT_EXAMPLES} generated examples (what `tpsim check` "
            f"does per variant by default) takes {' and '.join(totals)}, of which {' and '.join(starts)} "
            f"start the worlds (world sizes {sizes}; gloo starts one worker process per rank). Shrinking a "
            "failure to its minimal case adds a few dozen examples.")


#: The goals the checks section is judged against (on a quiet 2-core machine).
GOALS = {
    "gloo_ws4_s": 5.0, "gloo_ws4_over_inproc": 4.0, "gloo_default_s": 12.0, "gloo_megatron_s": 30.0,
    "isolation_slower": 0.10, "overhead_ratio": 2.0, "scale_ratio": 4.0,
}
#: The scale section's families with a goal: the largest size measured against its dense twin.
SCALE_TARGETS = {"mlp": "lab-note MLP check / dense forward+backward",
                 "embedding": "embedding check / dense forward+backward",
                 "cross-entropy": "cross-entropy check / dense forward+backward"}


def _scale_size(family: str, size: int) -> str:
    return f"hidden {size}" if family == "mlp" else f"vocab {size}"


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """``{target, goal, measured, met}`` rows from the checks and props sections (None: not measured)."""
    rows = _check_rows(result)

    def check_s(command: str, backend: str) -> float | None:
        r = rows.get((command, backend))
        return None if r is None else r.get("check_s")

    out = []

    def add(target: str, goal: str, value: float | None, text: str, ok: bool | None) -> None:
        out.append({"target": target, "goal": goal, "measured": value, "measured_text": text, "met": ok})

    g4, i4 = check_s("ws 1-4", "gloo"), check_s("ws 1-4", "inproc")
    add("gloo, column layer, 100 examples, world sizes 1-4", f"<= {GOALS['gloo_ws4_s']:g} s", g4,
        _secs(g4), None if g4 is None else g4 <= GOALS["gloo_ws4_s"])
    ratio = None if g4 is None or not i4 else g4 / i4
    add("the same, gloo / inproc", f"<= {GOALS['gloo_ws4_over_inproc']:g}x", ratio, _ratio(g4, i4),
        None if ratio is None else ratio <= GOALS["gloo_ws4_over_inproc"])
    gd = check_s("default", "gloo")
    add("gloo, the default command (world sizes 1,2,3,4,8)", f"<= {GOALS['gloo_default_s']:g} s", gd, _secs(gd),
        None if gd is None else gd <= GOALS["gloo_default_s"])
    gm = check_s("megatron", "gloo")
    add("gloo, Megatron-core preset, 10 examples, world sizes 1,2,4", f"<= {GOALS['gloo_megatron_s']:g} s", gm,
        _secs(gm), None if gm is None else gm <= GOALS["gloo_megatron_s"])
    props = result.get("props") or {}
    iso = (props.get("backends") or {}).get("inproc isolated") or {}
    plain = (props.get("backends") or {}).get("inproc") or {}
    slower = None
    if iso.get("fastest_per_example_s") and plain.get("fastest_per_example_s"):
        slower = iso["fastest_per_example_s"] / plain["fastest_per_example_s"] - 1.0
    add("isolated inproc vs plain, per example (props section)", f"<= {GOALS['isolation_slower'] * 100:.0f}% slower",
        slower, "—" if slower is None else f"{abs(slower) * 100:.1f}% {'slower' if slower >= 0 else 'faster'}",
        None if slower is None else slower <= GOALS["isolation_slower"])
    for family, label in SCALE_TARGETS.items():
        rows = ((result.get("scale") or {}).get("families") or {}).get(family) or []
        top = max(rows, key=lambda r: r["size"]) if rows else None
        ratio = None if top is None else top["ratio"]
        what = label if top is None else f"{label} ({_scale_size(family, top['size'])})"
        floor = "" if top is None or top.get("floor_ratio") is None else f"; floor {top['floor_ratio']:.1f}x"
        add(what, f"<= {GOALS['scale_ratio']:g}x", ratio,
            "—" if top is None else f"{ratio:.1f}x (CPU time: {top['cpu_ratio']:.1f}x{floor})",
            None if ratio is None else ratio <= GOALS["scale_ratio"])
    rows = (result.get("overhead") or {}).get("rows") or [{}]
    for row in rows:
        ratio = row.get("ratio")
        add(f"inproc cost per collective per rank / its floor, world size {row.get('world_size', '?')}, tiny tensors",
            f"<= {GOALS['overhead_ratio']:g}x", ratio, _overhead_text(row),
            None if ratio is None else ratio <= GOALS["overhead_ratio"])
    return out


def _overhead_text(row: dict[str, Any]) -> str:
    """``3.10x (13 us against a floor of 4.2 us; CPU time: 2.90x)``, or a dash when not measured."""
    if row.get("ratio") is None:
        return "—"
    cpu = f"; CPU time: {row['cpu_ratio']:.2f}x" if row.get("cpu_ratio") is not None else ""
    return f"{row['ratio']:.2f}x ({_s(row['wall_us'])} us against a floor of {_s(row['floor_us'])} us{cpu})"


def overhead_markdown(result: dict[str, Any]) -> list[str]:
    """The "Per-collective cost" section: inproc's cost per all_reduce per rank beside its floor."""
    ovh = result.get("overhead") or {}
    rows = ovh.get("rows") or []
    if not rows:
        return [] if not ovh.get("skipped") else ["## Per-collective cost", "", f"Not measured: {ovh['skipped']}.", ""]
    out = ["## Per-collective cost", "",
           "inproc's own cost of a collective, per rank: every rank of a world does the same number of "
           "`dist.all_reduce` calls on a one-element float32 tensor; *inproc us*: the world's time from the moment "
           "every rank has arrived at a first one until the last rank leaves its last, per call and rank (wall "
           "time; *CPU us*: the process's CPU time over the same stretch). Its *floor*, measured in the same "
           "process, the rounds interleaved, is what any backend that runs ranks as threads taking turns behind "
           "`torch.distributed` pays per collective and rank: one thread hand-off (the cheaper of a ring of "
           "threads passing a token with plain locks, *plain ring*, and the same ring with its threads placed as "
           "inproc places its rank threads, one CPU for all and `SCHED_BATCH`, *placed ring*) plus torch's own "
           "`dist.all_reduce` wrapper (what it adds to the process group's `allreduce` as it calls it) as one "
           "of as many threads taking turns runs it: *torch wrapper us*, the placed ring with every thread "
           "calling `dist.all_reduce` between hand-offs less the same ring calling the group's `allreduce` "
           "directly, on a one-rank world of a process group that does nothing (CPU time). In a loop of one "
           f"thread the wrapper costs less ({_s(ovh.get('torch_wrapper_hot_us'))} us: warm caches; on inproc's "
           f"own one-rank world {_s(ovh.get('torch_wrapper_inproc_us'))} us, its per-thread routing of "
           "torch.distributed's registry included, which counts as inproc's cost). What inproc adds to the floor "
           "is its own: the call's record, signature matching, the rank's RNG and default dtype swapped at its "
           "hand-off, bounded waits, the registry's per-thread routing, and the reduction itself delivered to "
           f"every rank. Fastest of {ovh.get('repeats', 1)} rounds of each; every sample is in bench.json "
           "(`overhead.rows`).", "",
           "| world size | calls per rank | inproc us | CPU us | plain ring us | placed ring us | torch wrapper us "
           "| floor us | inproc / floor | CPU / floor CPU |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['world_size']} | {r['calls']} | {_s(r['wall_us'])} | {_s(r['cpu_us'])} | "
                   f"{_s(r['plain_ring_us'])} | {_s(r['placed_ring_us'])} | {_s(r['torch_wrapper_us'])} | "
                   f"{_s(r['floor_us'])} | {_ratio(r['wall_us'], r['floor_us'])} | "
                   f"{_ratio(r['cpu_us'], r.get('floor_cpu_us'))} |")
    met = [r["world_size"] for r in rows if r.get("ratio") is not None and r["ratio"] <= GOALS["overhead_ratio"]]
    missed = [r["world_size"] for r in rows if r.get("ratio") is not None and r["ratio"] > GOALS["overhead_ratio"]]
    out += ["", f"The goal, inproc within {GOALS['overhead_ratio']:g}x of its floor at every world size: "
                + "; ".join(part for part in (f"met at {', '.join(map(str, met))}" if met else "",
                                              f"not met at {', '.join(map(str, missed))}" if missed else "") if part)
                + "."]
    if ovh.get("load") is not None:
        out += ["", f"Load average (1 min) when the section ended: {ovh['load']:.1f} (on "
                    f"{result['machine']['cores']} cores)."]
    out.append("")
    return out


def markdown(result: dict[str, Any], images: dict[str, str]) -> str:
    m = result["machine"]
    out = [
        "# tpsim benchmark",
        "",
        f"Generated by `python -m bench{' --quick' if result['quick'] else ''}` on {machine_line(m)} "
        f"({m['platform']}), {result['date']}; total {result['total_s']:.0f} s.",
        "Every number below comes from this one run; ratios compare measurements taken side by side.",
        "The machine was shared with other jobs while it ran (up to 4 other agents on 2 cores), so",
        "absolute times are noisy; ratios taken close together are the meaningful part.",
        "",
    ]
    load = result.get("load")
    if load:
        out[-1:] = [f"Load average (1 min) at the start of the run: {load['start']:.1f}, at the end: "
                    f"{load['end']:.1f} (on {m['cores']} cores).", ""]
    reruns = result.get("reruns") or {}
    if reruns:
        again = "; ".join(f"{name} on {r['date']} (load average {r['load']['start']:.1f} at its start, "
                          f"{r['load']['end']:.1f} at its end)" for name, r in reruns.items())
        out[-1:] = [f"Sections re-run on their own later (`python -m bench --only ...`), their ratios again side "
                    f"by side within them: {again}.", ""]
    wait = waits(result)
    if wait:
        out += ["## What you wait for", "", wait, ""]
    chk = result.get("checks")
    if chk and chk.get("rows"):
        extra = f" (every command also with `{' '.join(chk['extra'])}`)" if chk.get("extra") else ""
        out += [f"Each command run as `python -m tpsim check ... --report json` in a fresh process{extra}, "
                f"every backend in turn, {chk['rounds']} round{'s' if chk['rounds'] != 1 else ''}, the fastest "
                "kept. *check s*: the time the check reports (target import done, worker start-up included); "
                "*whole command s*: the process from start to exit; *inproc*: what `tpsim check` runs by default "
                "(the worlds in an isolated worker process); *pools replaced*: gloo worker pools replaced over all "
                "rounds (a refusal keeps its pool; only a death, a hang, a destroyed group or a corrupted state "
                "replaces one).", "",
                "| command | backend | check s | whole command s | examples | passed | pools replaced |",
                "|---|---|---:|---:|---:|:-:|---:|"]
        for r in chk["rows"]:
            passed = "—" if r.get("passed") is None else ("yes" if r["passed"] else "NO")
            out.append(f"| `{r.get('command_line') or r['what']}` | {r['backend']} | {_s(r.get('check_s'))} | {_s(r.get('wall_s'))} | "
                       f"{_s(r.get('examples'))} | {passed} | "
                       f"{'—' if r['backend'] != 'gloo' else _s(r.get('pool_replacements_total'))} |")
        for note in chk.get("notes") or []:
            out.append(f"\n{note}.")
        out += ["", "Goals (set for a quiet 2-core machine; the load of this run is above):", "",
                "| target | goal | measured | met |", "|---|---|---|:-:|"]
        for t in targets(result):
            met = "—" if t["met"] is None else ("yes" if t["met"] else "no")
            out.append(f"| {t['target']} | {t['goal']} | {t['measured_text']} | {met} |")
        out.append("")
    out += overhead_markdown(result)
    step = result.get("step")
    if step:
        out += [
            "## Collective step vs world size",
            "",
            f"The collective-step workload: {step['steps']} steps of a column-parallel linear forward+backward per rank "
            "(B=8, I=O=64 per rank, float32, autograd), one all_gather of the output and one all_reduce of the "
            "input grad per step; loop seconds (max over ranks). *floor*: the same arithmetic for "
            "every rank, rank after rank, in one thread, every rank receiving what the collectives deliver "
            "(its own copy of the gathered output and of the summed grad). *compute*: the same without "
            "delivery, each collective's result built once for nobody: a lower bound no backend can reach, "
            "shown for transparency. *threaded*: torch's internal `multi_threaded_pg` (a comparison, "
            "imported only by the benchmark). One intra-op thread everywhere.",
            "",
            f"Each number is the fastest of {step.get('repeats', 1)} runs for floor, compute and inproc, run "
            "interleaved in one process per world size (floor, compute, inproc, floor, ...), and of "
            f"{step.get('alone_repeats', step.get('repeats', 1))} for threaded and gloo, in processes of their "
            "own. A run of "
            f"{step.get('repeat_below_s', 10):g} s or more is not repeated. Every run's time is in bench.json "
            "(`step.samples`).",
            "",
            "### Headline",
            "",
            "| world size | floor s | inproc s | threaded s | inproc / floor | inproc / compute | threaded / inproc |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for h in headline(result):
            out.append(f"| {h['world_size']} | {_s(h['floor_s'])} | {_s(h['inproc_s'])} | {_s(h['threaded_s'])} | "
                       f"{_ratio(h['inproc_s'], h['floor_s'])} | {_ratio(h['inproc_s'], h['compute_s'])} | "
                       f"{_ratio(h['threaded_s'], h['inproc_s'])} |")
        worst = worst_over_floor(result)
        if worst is not None:
            out += ["", f"Furthest from the floor between world sizes 2 and 128: **{worst[1]:.2f}x** at world size "
                        f"{worst[0]} (the target: within 3x at every size)."]
        out += ["", "### All sizes", "",
                "| world size | floor s | compute s | inproc s | threaded s | gloo s | inproc/floor | inproc/compute "
                "| threaded/inproc | gloo/inproc |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        sec = step["seconds"]
        for ws in step["sizes"]:
            f, c, i, t, g = (_at(sec, b, ws) for b in ("floor", "compute", "inproc", "threaded", "gloo"))
            out.append(f"| {ws} | {_s(f)} | {_s(c)} | {_s(i)} | {_s(t)} | {_s(g)} | {_ratio(i, f)} | {_ratio(i, c)} "
                       f"| {_ratio(t, i)} | {_ratio(g, i)} |")
        for backend, why in step["skipped"].items():
            out.append(f"\n*{backend}*: {why}.")
        if "step" in images:
            out += ["", f"![collective step vs world size]({images['step']})"]
        out.append("")
    props = result.get("props")
    if props:
        out += ["## Property examples per second", "",
                f"`tpsim.props.check_case` (one world run + every property) on `{props['variant']}`, "
                "generated divisible cases at world sizes 1–4, each backend in a fresh process. *first example* "
                "is the first case at a world size: for gloo it includes starting that world's worker pool, "
                "reused afterwards.", "",
                "*interleaved*: the same cases with world sizes in the order a search draws them.", "",
                "| backend | examples/s | per example s | interleaved per example s | first example s (by world size) |",
                "|---|---:|---:|---:|---|"]
        for backend, r in props["backends"].items():
            if r is None:
                out.append(f"| {backend} | — | — | — | ran past its limit |")
                continue
            first = ", ".join(f"ws {k}: {_s(v)}" for k, v in r["first_s"].items())
            out.append(f"| {backend} | {_s(r['examples_per_s'])} | {_s(r['per_example_s'])} | "
                       f"{_s(r.get('interleaved_per_example_s'))} | {first} |")
        g, i = props["backends"].get("gloo"), props["backends"].get("inproc")
        if g and i:
            starts = [v for v in g["first_s"].values()]
            out += ["", f"gloo start-up (mean first example) is {_ratio(sum(starts) / len(starts), g['per_example_s'])} "
                    f"a reused-pool example; a reused-pool gloo example costs {_ratio(g['per_example_s'], i['per_example_s'])} "
                    "an inproc one."]
        change = props.get("isolation_examples_per_s_change")
        if change is not None:
            iso = props["backends"]["inproc isolated"]
            out += ["", "*inproc isolated* is what `tpsim check` runs: the same worlds in a supervised worker "
                    "process, so a rank that exits, crashes or hangs in native code cannot take the checker down. "
                    f"Measured in the same process as plain inproc, each case run both ways back to back, "
                    f"{iso.get('rounds', 1)} rounds, each case's fastest kept: {abs(change) * 100:.1f}% "
                    f"{'fewer' if change < 0 else 'more'} examples per second. Its first example also starts the "
                    "worker (a fork of the checker)."]
        out.append("")
    mut = result.get("mutants")
    if mut:
        out += ["## Mutants: examples and seconds to catch", ""]
        if mut.get("note"):
            out.append(mut["note"])
        else:
            out += [f"Every mutant in `tpsim.mutants.CATALOG` ({len(mut['rows'])} in this run): "
                    f"`tpsim.props.search.search(mutant.variant, max_examples={mut['max_examples']}, seed=0, "
                    "database=None)` on inproc. *examples to catch*: the example number at which the intended "
                    "diagnosis first appeared (`Failure.found_after`); *examples*/*seconds*: the whole search "
                    "including shrinking; *needs*: what a case must have for the bug to show.", "",
                    "| mutant | intended diagnosis | needs | caught | examples to catch | examples | seconds |",
                    "|---|---|---|:-:|---:|---:|---:|"]
            for r in mut["rows"]:
                caught = "yes" if r["caught"] else "NO: " + (", ".join(r["diagnoses"]) or "passed")
                out.append(f"| {r['mutant']} | {r['diagnosis']} | {r.get('needs') or '—'} | {caught} | "
                           f"{_s(r['found_after'])} | {r['examples']} | {_s(r['seconds'])} |")
            caught = [r for r in mut["rows"] if r["caught"]]
            if caught:
                worst = max(caught, key=lambda r: r["found_after"] or 0)
                out += ["", f"{len(caught)} of {len(mut['rows'])} caught with their intended diagnosis; the latest "
                        f"first catch was at example {worst['found_after']} ({worst['mutant']}); all searches took "
                        f"{_s(sum(r['seconds'] for r in mut['rows']))} s together."]
        out.append("")
    lab = result.get("labmlp")
    if lab:
        rows = lab.get("rows") or [dict(lab, config="gelu")]  # a result from before the gated row
        first = rows[0]
        out += ["## Lab-note MLP", "",
                f"`ParallelMLP` (hidden {first['hidden']}, intermediate {first['intermediate']}, tp {first['tp']}, "
                f"{first['dtype']}, tokens {first['tokens']}) built from a dense MLP (`DenseMLP`, the same "
                "activation), forward+backward on inproc, every rank's output, input grad and grad shards compared "
                "with the dense run. *swiglu, sequence parallel*: the gated MLP (packed gate/up weight, "
                "intermediate per part) with `sequence_parallel=True`, each rank taking and returning its shard of "
                "the sequence (dim -2). *dense fwd+bwd*: the dense MLP's own warm forward+backward.", "",
                "| MLP | dense fwd+bwd s | inproc world fwd+bwd s | whole check s | check / dense fwd+bwd | equal |",
                "|---|---:|---:|---:|---:|:-:|"]
        for r in rows:
            out.append(f"| {r['config']} | {_s(r['dense_fwd_bwd_s'])} | {_s(r['world_fwd_bwd_s'])} | {_s(r['check_s'])} | "
                       f"{_ratio(r['check_s'], r['dense_fwd_bwd_s'])} | {'yes' if r['equal'] else 'NO'} |")
        out.append("")
    out += scale_markdown(result, images)
    flt = result.get("faults")
    if flt:
        out += ["## Fault detection latency", ""]
        if flt.get("note"):
            out.append(flt["note"])
        else:
            out += [f"`tpsim.props.faults.fault_detection` on `{flt['variant']}`, {flt['case']}, collective timeout "
                    f"{flt['rows'][0]['timeout_s'] if flt['rows'] else '?'} s. *latency*: from the run's start until "
                    "the fault surfaced (an error, or a result the properties reject).", "",
                    "| backend | fault | detected | outcome | latency s | wall s |", "|---|---|:-:|---|---:|---:|"]
            for r in flt["rows"]:
                out.append(f"| {r['backend']} | {r['fault']} | {'yes' if r['detected'] else 'NO'} | {r['outcome']} | "
                           f"{_s(r['latency_s'])} | {_s(r['wall_s'])} |")
        out.append("")
    mem = result.get("memory")
    if mem:
        rows = [r for r in mem["rows"] if r]
        dense = next((r for r in rows if r["mode"] == "dense"), None)
        out += ["## Peak memory", "",
                f"Peak resident set (VmHWM after resetting it, fresh process, minus the RSS after imports) of a {mem['size']}x{mem['size']} "
                "float32 linear layer forward+backward (batch 8): dense, and as a ColumnParallelLinear (gather_output) "
                "on an inproc world, every rank's shard in the one process.", "",
                "| run | world size | peak MiB | vs dense |", "|---|---:|---:|---:|"]
        for r in rows:
            out.append(f"| {r['mode']} | {r['world_size']} | {_s(r['peak_mib'])} | {_ratio(r['peak_mib'], dense['peak_mib'] if dense else None)} |")
        out.append("")
    dt = result.get("dtensor")
    if dt:
        out += ["## DTensor path", "",
                "Per-example time of `check_case` at world size 2 (warm: the first example, and on gloo the pool "
                "start, excluded) for the DTensor adapters in `examples/` and tpsim's own column layer.", "",
                "| variant | inproc s/example | gloo s/example | gloo / inproc |", "|---|---:|---:|---:|"]
        for label, r in dt["rows"].items():
            i = (r.get("inproc") or {}).get("per_example_s")
            g = (r.get("gloo") or {}).get("per_example_s")
            out.append(f"| {label} | {_s(i)} | {_s(g)} | {_ratio(g, i)} |")
        out.append("")
    if "props" in images:
        out += [f"![examples per second]({images['props']})", ""]
    return "\n".join(out)


#: How the scale section's families are described in its table and plot.
SCALE_LABELS = {"mlp": "SwiGLU MLP (tp 2)", "embedding": "vocab-parallel embedding (tp 2)",
                "cross-entropy": "vocab-parallel cross-entropy (tp 2)"}


def scale_markdown(result: dict[str, Any], images: dict[str, str]) -> list[str]:
    """The scale section: each family's whole check against its dense twin, by size."""
    sc = result.get("scale")
    if not sc or not sc.get("families"):
        return []
    out = ["## Scale: a whole check vs the dense forward+backward", "",
           f"One case per size, checked whole by the family's `check_case` on inproc (not isolated): the "
           "float64 reference, the tp world (2 ranks, float32), every property. *dense fwd+bwd*: the same layer "
           "dense (float32, the same shapes) doing one forward+backward, measured in the same process right "
           f"before each check; {sc['rounds']} round{'s' if sc['rounds'] != 1 else ''} per size, each in a fresh "
           "process, the fastest of each kept. *CPU*: the same ratio in this process's CPU time (every thread), "
           "less disturbed by other jobs on the machine. The module check trains "
           f"{_train_steps()} and runs each of them three times (float64 reference, magnitude run, tp "
           "world): a floor of several dense forward+backwards before anything is compared. MLP: ffn = hidden x "
           f"11008/4096 (the lab note's proportion), tokens {sc['tokens']}; embedding: width "
           f"{sc['embedding_dim']}, tokens {sc['tokens']}; cross-entropy: logits of {sc['ce_tokens']} tokens. "
           "*floor*: what any check of the case costs at least besides running the layer, measured in plain torch "
           "beside it: drawing the case's random values (float32 normal draws, as the harness does) and one "
           "float64 forward+backward of the dense layer on them (the oracle); *floor / dense*: that plus one "
           "dense forward+backward (the layer itself), against the dense forward+backward; *check / floor*: the "
           "check against that same sum (floor s + dense fwd+bwd s). A check/dense goal "
           "below floor/dense cannot be met by any check that draws fresh values and judges them against a "
           "float64 reference. "
           f"Absolute seconds are from a shared machine (load average {sc['load']:.1f} at the end of the "
           "section, 2 cores): only the ratios, taken side by side, compare.", "",
           "| layer | size | dense fwd+bwd s | floor s | check s | check / dense | CPU: check / dense | "
           "floor / dense | check / floor | passed |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|:-:|"]
    for family, rows in sc["families"].items():
        for r in rows:
            fl = r.get("floor_ratio")
            floor_s = "—" if fl is None else _s(r["floor_s"])
            floor_over_dense = "—" if fl is None else f"{fl:.1f}x"
            check_over_floor = "—" if fl is None else f"{r['check_s'] / (r['floor_s'] + r['dense_s']):.1f}x"
            out.append(f"| {SCALE_LABELS.get(family, family)} | {_scale_size(family, r['size'])} | {_s(r['dense_s'])} | "
                       f"{floor_s} | {_s(r['check_s'])} | {r['ratio']:.1f}x | {r['cpu_ratio']:.1f}x | "
                       f"{floor_over_dense} | {check_over_floor} | "
                       f"{'yes' if r['passed'] else 'NO'} |")
    for family, why in (sc.get("skipped") or {}).items():
        out.append(f"\n{SCALE_LABELS.get(family, family)}: {why}.")
    if "scale" in images:
        out += ["", f"![check time against size]({images['scale']})"]
    return out + [""]


def _train_steps() -> str:
    """What the module check trains, in words (the default micro-batches of its two optimizer steps)."""
    try:
        from tpsim.props.module.case import ModuleCase
        from tpsim.props.rank import schedule
    except ImportError:
        return "3 SGD steps"
    plan = schedule(ModuleCase(world_size=1, sizes=(1,)))
    return f"{sum(plan)} micro-batches ({' then '.join(str(n) for n in plan)}, one SGD step after each group)"


def _scale_plot(plt: Any, sc: dict[str, Any], who: str, out_dir: str, prefix: str) -> str | None:
    """Check time and dense forward+backward time against size, one panel per family, log-log, each
    check point labelled with its ratio."""
    families = [(f, rows) for f, rows in sc["families"].items() if rows]
    if not families:
        return None
    fig, axes = plt.subplots(1, len(families), figsize=(4.2 * len(families), 4.2), squeeze=False)
    for ax, (family, rows) in zip(axes[0], families, strict=True):
        xs = [r["size"] for r in rows]
        ax.plot(xs, [r["check_s"] for r in rows], marker="s", label="whole check", color=BACKEND_COLOURS["inproc"])
        ax.plot(xs, [r["dense_s"] for r in rows], marker="o", label="dense fwd+bwd", color="#555555")
        if all(r.get("floor_s") is not None for r in rows):
            ax.plot(xs, [r["floor_s"] + r["dense_s"] for r in rows], marker="^", linestyle="--",
                    label="floor (draw + float64 oracle + dense)", color="#999999")
        for r in rows:
            ax.annotate(f"{r['ratio']:.1f}x", (r["size"], r["check_s"]), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.margins(y=0.15)  # room for the ratio labels above the top point
        ax.set_xlabel("hidden size" if family == "mlp" else "vocabulary size")
        ax.set_title(SCALE_LABELS.get(family, family), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("seconds (fastest round)")
    axes[0][0].legend(fontsize=8)
    fig.text(0.01, 0.01, f"{who}; shared machine: ratios, not seconds, compare", fontsize=7, alpha=0.8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    name = f"{prefix}_scale.png"
    fig.savefig(os.path.join(out_dir, name), dpi=110)
    plt.close(fig)
    return name


def plots(result: dict[str, Any], out_dir: str, prefix: str) -> dict[str, str]:
    """PNG figures (matplotlib, Agg); returns {name: file name relative to out_dir}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: dict[str, str] = {}
    who = machine_line(result["machine"])
    step = result.get("step")
    if step:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for backend, marker in (("floor", "o"), ("compute", "."), ("inproc", "s"), ("threaded", "^"), ("gloo", "D")):
            pts = [(int(ws), v) for ws, v in (step["seconds"].get(backend) or {}).items() if v is not None]
            if pts:
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=backend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel(f"seconds for {step['steps']} steps")
        ax.set_title("Column-linear fwd+bwd loop: all_gather + all_reduce per step", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.text(0.01, 0.01, who, fontsize=7, alpha=0.8)
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        name = f"{prefix}_step.png"
        fig.savefig(os.path.join(out_dir, name), dpi=110)
        plt.close(fig)
        made["step"] = name
    sc = result.get("scale")
    if sc and sc.get("families"):
        name = _scale_plot(plt, sc, who, out_dir, prefix)
        if name:
            made["scale"] = name
    props, dt = result.get("props"), result.get("dtensor")
    if props or dt:
        bars = props_bars(result)
        if bars:
            made["props"] = _props_plot(plt, bars, who, out_dir, prefix)
    return made


#: Colours of the backends in the plots (colour-blind safe: blue and orange).
BACKEND_COLOURS = {"inproc": "#1f77b4", "gloo": "#ff7f0e"}


def props_bars(result: dict[str, Any]) -> list[tuple[str, str, float]]:
    """``(variant, backend, examples per second)`` for the examples-per-second plot: tpsim's column
    layer from the props section, the DTensor adapters from the dtensor section."""
    bars = []
    for backend, r in ((result.get("props") or {}).get("backends") or {}).items():
        if r and r.get("examples_per_s"):
            bars.append(("tpsim ColumnParallelLinear\n(world sizes 1-4)", backend, float(r["examples_per_s"])))
    for label, r in ((result.get("dtensor") or {}).get("rows") or {}).items():
        if not label.startswith("DTensor"):
            continue
        for backend in ("inproc", "gloo"):
            v = (r.get(backend) or {}).get("per_example_s")
            if v:
                bars.append((f"{label}\n(world size 2)", backend, 1.0 / v))
    return bars


def _props_plot(plt: Any, bars: list[tuple[str, str, float]], who: str, out_dir: str, prefix: str) -> str:
    """Grouped bars, one group per variant, one bar per backend, on a linear axis from zero (the
    reader compares heights), each bar labelled with its value."""
    variants = list(dict.fromkeys(v for v, _, _ in bars))
    backends = list(dict.fromkeys(b for _, b, _ in bars))
    width = 0.8 / len(backends)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, backend in enumerate(backends):
        xs, ys = [], []
        for j, variant in enumerate(variants):
            for v, b, value in bars:
                if (v, b) == (variant, backend):
                    xs.append(j + (i - (len(backends) - 1) / 2) * width)
                    ys.append(value)
        drawn = ax.bar(xs, ys, width, label=backend, color=BACKEND_COLOURS.get(backend))
        ax.bar_label(drawn, fmt="%.0f", fontsize=9, padding=2)
    ax.set_xticks(range(len(variants)), variants, fontsize=9)
    ax.set_ylim(0, max(value for _, _, value in bars) * 1.15)
    ax.set_ylabel("property examples checked per second", fontsize=10)
    ax.set_title("How fast tpsim checks generated examples (higher is better; warm worlds)", fontsize=11)
    ax.legend(title="backend", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.text(0.01, 0.01, who, fontsize=8, alpha=0.8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    name = f"{prefix}_props.png"
    fig.savefig(os.path.join(out_dir, name), dpi=110)
    plt.close(fig)
    return name


def _md_section(md: str, title: str) -> str:
    import re

    m = re.search(r"^#+ " + re.escape(title) + r"\n(.*?)(?=^#+ |\Z)", md, re.S | re.M)
    return m.group(1).strip() if m else ""


def _tables(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.startswith("|"))


def readme_performance(md: str) -> str:
    """The README's "Performance" section body, from a rendered docs/bench.md: first what a user
    waits for, then the terms the tables use, then the tables."""
    worst = [line for line in _md_section(md, "Headline").splitlines() if line.startswith("Furthest from the floor")]
    wait = _md_section(md, "What you wait for")
    reruns = "".join(f" {line}" for line in md.splitlines()[:12] if line.startswith("Sections re-run"))
    return f"""{wait}

Measured by `python -m bench` (or `tox -e bench`), which regenerates [docs/bench.md](docs/bench.md),
the plots and this section; every ratio compares runs taken side by side in one run. {md.splitlines()[2]}{reruns}

Terms used below:

- *examples/s*: property examples checked per second: one world run of a generated case plus every
  property checked on it (tpsim's column layer, world sizes 1–4, worlds already started);
  *per example s* is its inverse; *interleaved*: the same cases with world sizes in the order a
  search draws them; *first example s*: the first example at each world size, which pays for
  starting that world (on gloo, one worker process per rank).
- *inproc*: tpsim's in-process backend (threads as ranks, one running at a time); *gloo*: real gloo
  process groups, one process per rank; *threaded*: torch's own threaded process group
  (`multi_threaded_pg`), a comparison.
- *floor*: the same arithmetic as a world's ranks, done rank after rank in one thread, every rank
  receiving its copy of what the collectives deliver: what any one-core simulation must at least do.
  *compute*: the floor without delivering results, a lower bound no backend can reach.
  In the goals: a scale goal's *floor* is drawing the case's random values plus one float64 dense
  forward+backward (the oracle) plus the layer run once, against the dense forward+backward; the
  per-collective goal's is a thread hand-off per rank (the cheaper of a plain ring of locks and the
  same ring placed as inproc places its rank threads) plus torch's own `dist.all_reduce` wrapper as
  one of as many threads taking turns runs it (see docs/bench.md, "Per-collective cost").
  A goal below its floor cannot be met by this design (see docs/bench.md, "Scale").
- *s* in the step table: seconds for the whole loop (the slowest rank), fastest of several runs;
  *a / b*: how many times longer a takes than b.
- Faults: *detected*: the fault surfaced, as an *error* naming the faulty rank and call or as a
  *result* the properties reject; *latency s*: from the start of the run until it surfaced;
  *wall s*: the whole fault run, clean reference run included.

Property examples per second:

{_tables(_md_section(md, "Property examples per second"))}

![examples per second](docs/bench_props.png)

Collective step (200 steps of a column-parallel linear forward+backward, one all_gather and one
all_reduce per step) at three world sizes:

{_tables(_md_section(md, "Headline"))}

{worst[0] if worst else ""}

![collective step vs world size](docs/bench_step.png)

Fault detection latency (fault kind × backend):

{_tables(_md_section(md, "Fault detection latency"))}

Mutant catch table, lab-note-scale MLP, peak memory and the DTensor path: [docs/bench.md](docs/bench.md);
every catalogued mutant with its mechanism and public reports: [docs/bugs.md](docs/bugs.md).
"""


def update_readme(readme: str, md: str) -> str:
    """``readme`` with its "## Performance" section replaced by :func:`readme_performance`."""
    import re

    pattern = re.compile(r"(^## Performance\n\n)(.*?)(?=^## )", re.S | re.M)
    if not pattern.search(readme):
        raise ValueError("README has no '## Performance' section followed by another '## ' section")
    return pattern.sub(lambda m: m.group(1) + readme_performance(md) + "\n", readme, count=1)
