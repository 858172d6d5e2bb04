"""What several test modules share: running the ``tpsim`` command in-process, the error-table check
and the forward-backward run of the layer tests, and a collective program the fault tests inject into.

Functions a world runs are module-level here, so gloo workers import them by name.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

__all__ = [
    "BUGGY",
    "FAST",
    "ROOT",
    "assert_case_replays_on_gloo",
    "assert_errors_before_any_collective",
    "errors_raised",
    "forward_backward",
    "run_cli",
    "steps_loop",
    "tracked_files",
]

# ------------------------------------------------------------------------------ the tpsim command

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: The skill example's buggy row layer (bias-duplication), named as the docs name it: relative to ROOT.
BUGGY = "examples/skill_convention.py:BuggyRowParallelLinear"
#: Small budgets keep each run to about a second on the in-process backend.
FAST = ["--max-examples", "10", "--world-sizes", "1,2,3", "--seed", "0"]


def tracked_files(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The files git tracks under ``root`` (that still exist in the working tree).

    Project tests read these and nothing else: a checkout holds untracked things that are not the
    project's (a ``venv`` made inside it, build output), and CI's fresh clone has only these.
    """
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    paths = [root / name for name in listed.decode().split("\0") if name]
    return [p for p in paths if p.is_file()]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``tpsim ARGV`` in this process: the exit code and what it printed to stdout and stderr."""
    from tpsim.cli import main  # here, not at the top: gloo workers import this module for steps_loop

    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_case_replays_on_gloo(capsys: pytest.CaptureFixture[str], cases_dir: pathlib.Path, target: str,
                                family: str, failure: str) -> None:
    """``tpsim check TARGET`` on inproc fails with ``failure`` (``"property: diagnosis"``) and saves a
    case file of ``family``, which ``tpsim replay --backend gloo`` reproduces."""
    code, out, _ = run_cli(capsys, "check", target, "--seed", "0", "--max-examples", "20", "--world-sizes", "1,2",
                           "--cases-dir", str(cases_dir))
    assert code == 1 and f"FAILED {failure}" in out, out
    prop = failure.split(":")[0].replace("-", "_")
    case_file = next(cases_dir.glob(f"*{prop}*.json"))
    assert json.loads(case_file.read_text())["family"] == family
    code, out, _ = run_cli(capsys, "replay", str(case_file), "--backend", "gloo")
    assert code == 1 and f"FAIL reproduced: {failure}" in out, out


# ------------------------------------------------------------------------------ error tables

#: An error table: name -> (a bad action, the exception type it must raise, the exact message).
ErrorCases = dict[str, tuple[Callable[[], Any], type, str]]


def errors_raised(cases: ErrorCases, names: list[str]) -> dict[str, tuple[type | None, str]]:
    """Run each named bad action (on this rank); report ``(exception type, message)`` or that nothing was raised.

    Called from a test module's own module-level rank function, which gloo workers import by name
    (the actions are lambdas, which do not pickle).
    """
    seen: dict[str, tuple[type | None, str]] = {}
    for name in names:
        try:
            cases[name][0]()
        except Exception as e:  # noqa: BLE001 - the test compares type and message
            seen[name] = (type(e), str(e))
        else:
            seen[name] = (None, "nothing raised")
    return seen


def assert_errors_before_any_collective(result: Any, cases: ErrorCases, world_size: int) -> None:
    """Every rank of ``result`` (a world that ran :func:`errors_raised` over all of ``cases``) raised
    each case's type and exact message, and issued no collective: it raised before any."""
    for rank in range(world_size):
        assert result.trace.of(rank) == [], f"rank {rank} communicated: {result.trace.ops(rank)}"
        for name, (_, etype, message) in cases.items():
            got_type, got_message = result.values[rank][name]
            assert got_type is etype and got_message == message, (
                f"{name} on rank {rank}: got {got_type.__name__ if got_type else None}: {got_message!r}\n"
                f"expected {etype.__name__}: {message!r}"
            )


# ------------------------------------------------------------------------------ a layer's results


def forward_backward(module: torch.nn.Module, x: torch.Tensor, gy: torch.Tensor) -> dict[str, torch.Tensor]:
    """``module(x)`` and its backward from ``gy``: the output ``y``, the input grad ``gx`` and every
    parameter's grad by its dotted name (on this rank)."""
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(gy)
    return {"y": y.detach(), "gx": x.grad, **{name: p.grad for name, p in module.named_parameters()}}


# ------------------------------------------------------------------------------ a collective program

_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def steps_loop(steps: int = 3) -> torch.Tensor:
    """One all_gather and one all_reduce per step: call 2k+1 is a gather, 2k+2 a reduce (1-based)."""
    r, ws = dist.get_rank(), dist.get_world_size()
    x = torch.arange(4, dtype=torch.float32) + 10 * r
    out = torch.empty(4 * ws)
    for _ in range(steps):
        _GATHER(out, x)
        x = out[4 * r:4 * r + 4].clone() + out.sum() / 100
        dist.all_reduce(x)
    return x
