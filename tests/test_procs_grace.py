"""After one rank of a gloo world fails, its peers still running their own code are waited for."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

import tpsim

pytestmark = pytest.mark.gloo


def rank_raises_late(delay: float) -> None:
    """Rank 1 refuses at once; rank 0 works ``delay`` s in its own code (as if descheduled), then refuses too."""
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses at once")
    time.sleep(delay)
    raise ValueError("rank 0 refuses late")


def test_a_peer_that_raises_late_is_named_as_raising_not_stopped() -> None:
    # Well past any fixed grace period, well within the run's bound (the timeout).
    with pytest.raises(tpsim.RankError) as info:
        tpsim.run(rank_raises_late, 2, args=(2.0,), backend="gloo", timeout=20.0)
    err = info.value
    assert err.rank == 0 and "rank 0 refuses late" in str(err), str(err)
    assert set(err.errors) == {0, 1}
    assert all(isinstance(e, ValueError) for e in err.errors.values()), err.errors
    assert "rank 0 refuses late" in str(err.errors[0]) and "rank 1 refuses at once" in str(err.errors[1])
