"""The verdict is reached where the checked code never ran.

``tpsim check`` judges in its session worker, which never imports the target: the target is
resolved in a worker and described as plain data (tpsim/props/described.py), its ranks and a
module's dense reference run in workers, and what they send back is plain data
(tpsim/comm/plain.py). These tests hold the architecture to that: the target records every
process that imports it; a target that patches tpsim or torch at import, returns a tensor subclass
that lies about its values, or starts a process that deletes the saved case file, gets the verdict
it would get without doing so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tpsim.comm import plain

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hostile_probes import Probe, run_probe  # noqa: E402

_ROW = ("--kind", "row", "--output", "partial")
#: The skill's row layer (bias added on every rank before the caller's all-reduce): bias-duplication.
_BIAS_TWICE = "from tpsim.mutants.row import RowBiasBeforeReduce as Row\n"

#: A target that records, at import, which process imports it and whether that process is the judge.
_RECORDS = """
import json, os
import tpsim.session as _session
_channel = _session._WORKER.get("channel")
with open(os.environ["TPSIM_PROBE_IMPORTS"], "a") as _fh:
    _fh.write(json.dumps({"pid": os.getpid(), "judge": _channel is not None and _channel.pid == os.getpid()}) + "\\n")
"""


def _imports(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# --- plain data (fast) ---------------------------------------------------------------------------


class _Liar(torch.Tensor):
    """A tensor subclass whose ``__torch_function__`` halves what every read returns."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func in (torch.Tensor.detach, torch.Tensor.clone, torch.Tensor.to, torch.Tensor.__reduce_ex__):
            with torch._C.DisableTorchFunction():
                return torch.Tensor.as_subclass(out, torch.Tensor) / 2 if isinstance(out, torch.Tensor) else out
        return out


def test_a_tensor_subclass_ships_what_it_holds_not_what_it_says() -> None:
    held = torch.arange(4.0)
    liar = held.clone().as_subclass(_Liar)
    assert torch.equal(liar.detach().as_subclass(torch.Tensor), held / 2)  # what it says
    for shipped in (plain.plain_tensor(liar), plain.loads(plain.dumps(liar))):
        assert type(shipped) is torch.Tensor
        assert torch.equal(shipped, held)  # what it holds


def test_the_checked_codes_objects_reach_the_judge_as_stand_ins() -> None:
    class UserError(ValueError):
        pass

    class Layer:
        pass

    UserError.__module__ = Layer.__module__ = "tpsim_target_user_code"
    sent = plain.loads(plain.dumps({"fn": lambda: 1, "cls": Layer, "obj": Layer(), "err": UserError("bad size 3"),
                                    "ok": (ValueError("kept"), torch.ones(2), [1, "a"])}))
    assert isinstance(sent["fn"], plain.Foreign) and sent["fn"].__name__ == "<lambda>"
    assert isinstance(sent["cls"], plain.Foreign) and sent["cls"].__qualname__.endswith("Layer")
    assert sent["obj"].text == f"<tpsim_target_user_code.{Layer.__qualname__} object>"
    assert isinstance(sent["err"], plain.ForeignError) and "bad size 3" in str(sent["err"])
    assert "ValueError" in sent["err"].bases
    assert isinstance(sent["ok"][0], ValueError) and torch.equal(sent["ok"][1], torch.ones(2))
    with pytest.raises(RuntimeError, match="never in the process that judges"):
        sent["fn"]()


def test_the_judge_refuses_to_import_what_a_worker_should_not_have_sent() -> None:
    import pickle

    class Sneaky:
        pass

    Sneaky.__module__ = "os"  # pickled by reference to a module the judge may import: allowed
    data = pickle.dumps(plain.Foreign("m", "q", "t"))
    assert plain.loads(data) == plain.Foreign("m", "q", "t")
    forged = pickle.dumps(Path("x")).replace(b"pathlib", b"evilmod")
    with pytest.raises(pickle.UnpicklingError, match="never imports the checked code"):
        plain.loads(forged)


def test_a_variant_changed_after_it_was_resolved_reaches_the_workers_changed() -> None:
    from tpsim.placement import Shard
    from tpsim.props.launch import target_ref, variant_of
    from tpsim.target import resolve_target
    from tpsim.variant import ParamSpec

    (variant,) = resolve_target("tpsim.layers:ColumnParallelLinear")
    assert target_ref(variant, "inproc", True)[3] == ()
    changed = variant.replace(params=(ParamSpec("weight", "weight", Shard(0, parts=(1, 1))), *variant.params[1:]))
    ref = target_ref(changed, "inproc", True)
    assert dict(ref[3])["params"] == changed.params  # (and what replace() derived from it: packed)
    resolved = variant_of({"ref": ref})
    assert resolved.params == changed.params and resolved.packed == changed.packed


# --- the architecture, end to end (thorough) -------------------------------------------------------


def _check(probe: Probe, tmp_path: Path, **env: str) -> object:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return run_probe(probe, tmp_path)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["row", "module"])
def test_the_judging_process_never_imports_a_target(kind: str, tmp_path: Path) -> None:
    record = tmp_path / "imports.jsonl"
    if kind == "row":
        probe = Probe("records-its-importers", _RECORDS + _BIAS_TWICE, args=_ROW)
    else:
        probe = Probe("records-its-importers-module", _RECORDS + "from tpsim.layers import ParallelMLP as MLP\n",
                      target="{file}:MLP", args=("--kind", "module"), max_examples=3)
    run = _check(probe, tmp_path, TPSIM_PROBE_IMPORTS=str(record))
    assert run.code == (1 if kind == "row" else 0), run
    imports = _imports(record)
    assert imports, "the target was never imported"
    assert not [i for i in imports if i["judge"]], f"the judging process imported the target: {imports}"
    if kind == "row":  # the replay judges in a process that never imports it either
        record.unlink()
        case = run.cases[0]
        replay = subprocess.run([sys.executable, "-m", "tpsim", "replay", str(case)], cwd=run.cwd,
                                capture_output=True, text=True, timeout=300,
                                env={**os.environ, "TPSIM_PROBE_IMPORTS": str(record)})
        assert replay.returncode == 1, replay.stdout + replay.stderr
        assert "reproduced: forward-equivalence: bias-duplication" in replay.stdout
        assert _imports(record) and not [i for i in _imports(record) if i["judge"]]


_PATCHES = {
    "tpsim's compare functions and its channel": """
import tpsim.patterns, tpsim.props.linear.checks, tpsim.session, tpsim.diagnosis
tpsim.patterns.close = tpsim.props.linear.checks.close = lambda *a, **k: True
tpsim.diagnosis.close = lambda *a, **k: True
tpsim.session._Channel.send = lambda self, **event: None
""",
    "torch's comparisons": """
import torch
torch.Tensor.__le__ = lambda a, b: torch.ones(a.shape, dtype=torch.bool)
torch.allclose = lambda *a, **k: True
torch.isclose = lambda a, b, *r, **k: torch.ones(a.shape, dtype=torch.bool)
""",
}


@pytest.mark.slow
@pytest.mark.parametrize("what", sorted(_PATCHES))
def test_patching_at_import_changes_no_verdict(what: str, tmp_path: Path) -> None:
    run = run_probe(Probe("patches-" + what.split()[0], _PATCHES[what] + _BIAS_TWICE, args=_ROW), tmp_path)
    assert run.code == 1, run
    assert "FAILED forward-equivalence: bias-duplication" in run.out, run.out


@pytest.mark.slow
def test_a_tensor_subclass_that_lies_cannot_hide_a_doubled_forward(tmp_path: Path) -> None:
    source = """
import torch
from tpsim.mutants.column import CorrectColumn
class _Liar(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func in (torch.Tensor.detach, torch.Tensor.clone, torch.Tensor.to, torch.Tensor.__reduce_ex__):
            with torch._C.DisableTorchFunction():
                return torch.Tensor.as_subclass(out, torch.Tensor) / 2 if isinstance(out, torch.Tensor) else out
        return out
class Row(CorrectColumn):
    def forward(self, x):
        return (2 * super().forward(x)).as_subclass(_Liar)
"""
    run = run_probe(Probe("liar-subclass", source, args=("--kind", "column", "--output", "sharded")), tmp_path)
    assert run.code == 1, run
    assert "FAILED forward-equivalence" in run.out, run.out


@pytest.mark.slow
def test_a_case_file_a_ranks_process_deletes_is_written_again(tmp_path: Path) -> None:
    source = _BIAS_TWICE.replace(" as Row", " as _Row") + """
import os, subprocess, sys
class Row(_Row):
    def forward(self, x):
        if not getattr(Row, "started", False):
            Row.started = True  # a process outside the check's group that deletes every case file it finds
            subprocess.Popen([sys.executable, "-c", "import glob, os, time\\nfor _ in range(200):\\n"
                              "    [os.remove(p) for p in glob.glob('.tpsim/cases/*.json')]\\n    time.sleep(0.05)"],
                             start_new_session=True)
        return super().forward(x)
"""
    run = run_probe(Probe("deletes-case-files", source, args=_ROW), tmp_path)
    assert run.code == 1, run
    assert run.orphans == []
    assert run.cases, "the case file is gone"
    replay = subprocess.run([sys.executable, "-m", "tpsim", "replay", str(run.cases[0])], cwd=run.cwd,
                            capture_output=True, text=True, timeout=300)
    assert "reproduced: forward-equivalence: bias-duplication" in replay.stdout, replay.stdout + replay.stderr
