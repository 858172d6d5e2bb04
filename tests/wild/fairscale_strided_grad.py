"""fairscale 0.4.13's ColumnParallelLinear on real gloo processes, without tpsim: given a transposed
(non-contiguous) 2-D input, its backward all-reduces the input grad as a non-contiguous view, which
NCCL refuses.

``_CopyToModelParallelRegion.backward`` (fairscale/nn/model_parallel/mappings.py) calls
``_reduce(None, grad_output)``, which passes ``grad_output`` to ``torch.distributed.all_reduce`` as it
is. Autograd hands it a non-contiguous grad exactly when the input is one (``mm``'s backward lays the
input grad out like the input: a transposed ``x.t()``, a sequence-first view). Plain gloo reduces the
view's storage, which here holds exactly its elements, so the values come out right on gloo; NCCL
checks every tensor it is given (``ProcessGroupNCCL``: ``Tensors must be contiguous``) and raises, so
the same training step fails on GPUs. This script records what ``all_reduce`` is given and compares
the input grad with the dense one's; it exits 1 when a non-contiguous tensor reaches ``all_reduce``.
``--fixed`` runs fairscale's ``_reduce`` with ``input_ = input_.contiguous()`` first (the reduced copy
is what it returns) and exits 0.

Run: ``python tests/wild/fairscale_strided_grad.py`` (and ``--fixed``).
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 2
IN, OUT, ROWS = 4, 6, 3


def _contiguous_reduce(ctx, input_):
    """fairscale's ``_reduce`` with the fix: the collective gets a contiguous tensor, which is returned."""
    from fairscale.nn.model_parallel.initialize import get_model_parallel_group

    group = get_model_parallel_group()
    if not input_.is_contiguous():
        input_ = input_.contiguous()  # a copy: the copy is reduced and returned (nothing to mark dirty)
    elif ctx:
        ctx.mark_dirty(input_)
    if dist.get_world_size(group=group) == 1:
        return input_
    dist.all_reduce(input_, group=group)
    return input_


def _rank(rank: int, port: int, fixed: bool, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from fairscale.nn.model_parallel import initialize, layers, mappings

    initialize.initialize_model_parallel(WORLD)
    if fixed:
        mappings._reduce = _contiguous_reduce
    given = []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        given.append((tuple(tensor.shape), tuple(tensor.stride()), tensor.is_contiguous()))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT, dtype=torch.float64)
    x = torch.randn(IN, ROWS, dtype=torch.float64).t().requires_grad_(True)  # a transposed 2-D input
    g = torch.randn(ROWS, OUT, dtype=torch.float64)
    ref = x.detach().clone().requires_grad_(True)
    (dense(ref) * g).sum().backward()
    tp = layers.ColumnParallelLinear(IN, OUT, bias=True, gather_output=False).to(torch.float64)
    with torch.no_grad():
        tp.weight.copy_(dense.weight.chunk(WORLD)[rank])
        tp.bias.copy_(dense.bias.chunk(WORLD)[rank])
    (tp(x) * g.chunk(WORLD, dim=-1)[rank]).sum().backward()
    queue.put((rank, float((x.grad - ref.grad).abs().max()), given))
    dist.destroy_process_group()


def main() -> int:
    fixed = "--fixed" in sys.argv
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, fixed, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    bad = False
    for rank, err, given in results:
        strided = [(shape, strides) for shape, strides, contiguous in given if not contiguous]
        print(f"rank {rank}: max |input grad - dense| {err:.3g}; all_reduce calls {len(given)}, given a "
              f"non-contiguous tensor {len(strided)}" + (f" (shape {list(strided[0][0])}, strides "
                                                        f"{list(strided[0][1])})" if strided else ""))
        bad |= bool(strided)
    print("DEFECT: all_reduce is given a non-contiguous view (NCCL raises 'Tensors must be contiguous')" if bad
          else "OK: every all_reduce is given a contiguous tensor")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
