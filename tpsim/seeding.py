"""Seeding every rank alike, as training scripts do before they build a model, at the cost of one
generator where there is only one.

``torch.manual_seed`` seeds the CPU generator and queues a seed for every other kind of device
(CUDA, XPU, MTIA), formatting the caller's stack for each queued call: about 1 ms, paid by every
rank of every case (a tenth of a search's time on tpsim's own layers, measured). On a machine with
no accelerator only the CPU generator can ever be used, so only it is seeded there; where an
accelerator is present (the NCCL path) the full ``torch.manual_seed`` runs, so a layer's CUDA
random numbers start from the case's seed as well.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["manual_seed"]


@functools.cache
def _accelerated() -> bool:
    """Whether any device besides the CPU can hold tensors in this process (asked once)."""
    checks = (
        lambda: torch.cuda.is_available(),
        lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
        lambda: torch.backends.mps.is_available(),
        lambda: hasattr(torch, "mtia") and torch.mtia.is_available(),
    )
    for check in checks:
        try:
            if check():
                return True
        except Exception:  # a backend that cannot even answer: take the full path, as if present
            return True
    return False


def manual_seed(seed: int) -> None:
    """``torch.manual_seed(seed)``: every generator a tensor of this process can draw from."""
    if torch.cuda.is_initialized() or _accelerated():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)
