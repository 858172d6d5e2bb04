"""The pytest plugin as a user meets it: options, fixtures and the SPMD marker, run in a sub-pytest."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.distributed as dist

pytest_plugins = ["pytester"]


@pytest.mark.tpsim_spmd(world_size=3)
def test_spmd_marker_runs_body_on_every_rank() -> None:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    assert dist.get_world_size() == 3
    assert t.item() == 6.0


@pytest.mark.tpsim_spmd
def test_spmd_marker_parametrised_over_world_sizes(tpsim_world_size: int) -> None:
    assert dist.get_world_size() == tpsim_world_size


def test_tpsim_world_fixture(tpsim_world) -> None:
    ranks = tpsim_world(dist.get_rank, 4)
    assert ranks == [0, 1, 2, 3]


def _user_suite(pytester: pytest.Pytester, body: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_user=textwrap.dedent(body))
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", *args)


@pytest.mark.slow
def test_failing_rank_fails_the_test_with_its_traceback(pytester: pytest.Pytester) -> None:
    result = _user_suite(
        pytester,
        """
        import pytest, torch.distributed as dist

        @pytest.mark.tpsim_spmd(world_size=2)
        def test_rank_one_breaks():
            if dist.get_rank() == 1:
                raise KeyError("only on rank one")
        """,
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 1*", "*KeyError*only on rank one*"])


@pytest.mark.slow
def test_world_size_option_parametrises(pytester: pytest.Pytester) -> None:
    result = _user_suite(
        pytester,
        """
        def test_sizes(tpsim_world_size, tpsim_world):
            import torch.distributed as dist
            assert tpsim_world(dist.get_world_size, tpsim_world_size) == [tpsim_world_size] * tpsim_world_size
        """,
        "--tpsim-world-sizes", "1,3,5", "-v", "-v",
    )
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*test_sizes?1?*PASSED*", "*test_sizes?5?*PASSED*"])


@pytest.mark.slow
def test_bad_world_sizes_option_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = _user_suite(pytester, "def test_x(tpsim_world_size):\n    pass\n", "--tpsim-world-sizes", "2,x")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--tpsim-world-sizes='2,x'*comma-separated integers*"])


@pytest.mark.gloo
def test_gloo_backend_option(pytester: pytest.Pytester) -> None:
    result = _user_suite(
        pytester,
        """
        import os

        import torch.distributed as dist

        def test_backend(tpsim_world, tpsim_backend):
            assert tpsim_backend == "gloo"
            assert tpsim_world(dist.get_backend, 2) == ["gloo", "gloo"]
            assert len(set(tpsim_world(os.getpid, 2))) == 2  # processes, not threads
        """,
        "--tpsim-backend", "gloo",
    )
    result.assert_outcomes(passed=1)
