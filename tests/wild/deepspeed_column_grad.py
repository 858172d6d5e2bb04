"""DeepSpeed AutoTP's LinearLayer on real gloo processes, without tpsim: the input grad of a
transposed (non-contiguous) 2-D input is one rank's summand, not the dense grad.

``ColumnParallel.backward`` (deepspeed/module_inject/layers.py) all-reduces
``grad_output.contiguous()``, a copy when the grad is not contiguous, and returns the original, which
was never reduced. Autograd hands it a non-contiguous grad exactly when the input is: ``mm``'s
backward lays the input grad out like the input. Run: ``python tests/wild/deepspeed_column_grad.py``.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 2
IN, OUT, ROWS = 4, 6, 3


def _rank(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import deepspeed.comm as ds_comm
    import deepspeed.ops as ops
    from deepspeed.module_inject import layers

    ops.__dict__.setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False  # no JIT build of the CPU op
    ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    layers.set_autotp_mode(training=True)
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT, dtype=torch.float64)
    x_t = torch.randn(IN, ROWS, dtype=torch.float64)
    g = torch.randn(ROWS, OUT, dtype=torch.float64)
    errors = {}
    for layout in ("contiguous", "transposed"):
        x = (x_t.t().contiguous() if layout == "contiguous" else x_t.t()).requires_grad_(True)
        ref = x.detach().clone().requires_grad_(True)
        (dense(ref) * g).sum().backward()
        tp = layers.LinearLayer(nn.Linear(IN, OUT, dtype=torch.float64).requires_grad_(False), dist.group.WORLD)
        with torch.no_grad():
            tp.weight.copy_(dense.weight.chunk(WORLD)[rank])
            tp.bias.copy_(dense.bias.chunk(WORLD)[rank])
        tp.weight.requires_grad_(True)
        tp.bias.requires_grad_(True)
        (tp(x) * g.chunk(WORLD, dim=-1)[rank]).sum().backward()
        errors[layout] = float((x.grad - ref.grad).abs().max())
    queue.put((rank, errors))
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    for rank in sorted(results):
        errs = results[rank]
        print(f"rank {rank}: max |input grad - dense| contiguous input {errs['contiguous']:.3g}, "
              f"transposed input {errs['transposed']:.3g}")


if __name__ == "__main__":
    main()
