"""torchrun mode: under ``torchrun`` tpsim.run uses the launched world instead of spawning one."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap

import pytest

pytestmark = pytest.mark.gloo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist, tpsim
    from tpsim.faults import Mismatch

    def total():
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return t.item()

    def boom():
        dist.barrier()
        if dist.get_rank() == 1:
            raise ValueError("boom on rank 1")
        return 0

    if __name__ == "__main__":
        result = tpsim.run_world(total, 2, backend="gloo", timeout=30)
        print(f"rank {os.environ['RANK']} values {result.values} ops {result.trace.ops(1)}", flush=True)
        try:
            tpsim.run(boom, 2, backend="gloo", timeout=30)
        except tpsim.RankError as err:
            print(f"rank {os.environ['RANK']} error rank={err.rank} {str(err).splitlines()[0]}", flush=True)
        try:
            tpsim.run(total, 2, backend="gloo", timeout=30, faults=[Mismatch(0, 1, what="dtype")])
        except tpsim.CollectiveError as err:
            print(f"rank {os.environ['RANK']} fault faulty={err.faulty_ranks}", flush=True)
""")


def test_torchrun_standalone_two_ranks_on_gloo(tmp_path):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH (it comes with torch's console scripts)")
    script = tmp_path / "launched.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(script)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for rank in (0, 1):
        assert f"rank {rank} values [3.0, 3.0] ops ['all_reduce']" in out
        assert f"rank {rank} error rank=1 rank 1 raised ValueError: boom on rank 1" in out
        assert f"rank {rank} fault faulty=(0,)" in out


def _torchrun_check(tmp_path, *check_args: str) -> subprocess.CompletedProcess[str]:
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH (it comes with torch's console scripts)")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "tpsim", "check", *check_args,
           "--backend", "gloo", "--max-examples", "8"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)


def test_tpsim_check_under_torchrun_uses_the_launched_world(tmp_path):
    proc = _torchrun_check(tmp_path, "tpsim.layers:RowParallelLinear")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Rank 0 alone reports; the launcher's world size is the only one checked.
    assert proc.stdout.count("tpsim check tpsim.layers:RowParallelLinear: 1 variant on gloo, world sizes 2,") == 1
    assert "all properties hold: 1 variant" in proc.stdout


def test_tpsim_check_under_torchrun_finds_a_mutant(tmp_path):
    proc = _torchrun_check(tmp_path, "tpsim.mutants:row_bias_before_reduce")
    assert proc.returncode != 0
    assert proc.stdout.count("FAILED forward-equivalence: bias-duplication") == 1, proc.stdout + proc.stderr
    assert list((tmp_path / ".tpsim" / "cases").glob("*.json")), "rank 0 saves the minimal case"
