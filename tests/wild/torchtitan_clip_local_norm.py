"""torchtitan 0.3.0: gradient clipping under tensor parallelism with the default ``spmd_types`` backend
uses each rank's own grad norm. Plain torch.distributed on gloo, 2 processes, no tpsim.

torchtitan's trainer runs forward and backward inside ``get_spmd_context`` and then, outside it, calls
``torchtitan.distributed.utils.clip_grad_norm_`` on the model's parameters. With
``spmd_backend="spmd_types"`` the parameters ``Module.parallelize`` leaves are plain local tensors (not
DTensors), so ``torch.nn.utils.get_total_norm`` sums only this rank's pieces and nothing reduces the
squares over the tp group: each rank returns, and clips by, a different norm. The dense model's norm
is ``sqrt(sum over ranks of the local squares)``.

Run: python tests/wild/torchtitan_clip_local_norm.py      (prints the norms and exits 1 on the defect)
The fix (``--fixed``): all-reduce the sum of the local squares over the tp group before the square root
(what ``clip_grad_norm_`` does for DTensor grads through ``full_tensor()``); every rank then returns the
dense norm.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TP = 2
HIDDEN, FFN = 4, 8


def build_ffn():
    import spmd_types as spmd
    from torchtitan.models.common.decoder_sharding import dense_activation_placement, set_dense_ffn_sharding
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear

    config = FeedForward.Config(w1=Linear.Config(in_features=HIDDEN, out_features=FFN),
                                w2=Linear.Config(in_features=FFN, out_features=HIDDEN),
                                w3=Linear.Config(in_features=HIDDEN, out_features=FFN))
    # As set_llama3_sharding_config shards every layer without sequence parallelism.
    set_dense_ffn_sharding(config, attn_x_layout=dense_activation_placement(tp=spmd.I), enable_sp=False)
    return FeedForward(config).to(torch.float64)


def worker(rank: int, init_file: str, fixed: bool, out) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP)
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import clip_grad_norm_, get_spmd_context

    parallel_dims.device_type = "cpu"  # no accelerator here (torchtitan's default is "cuda")
    torch.manual_seed(0)
    dense = build_ffn()
    model = build_ffn()
    model.load_state_dict(dense.state_dict())
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=TP, pp=1, ep=1, world_size=TP,
                        spmd_backend="spmd_types")
    dims.build_mesh()
    model.parallelize(dims)
    x = torch.randn(2, 3, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    # The dense model's grads and norm (every rank computes the same).
    dense(x).square().sum().backward()
    dense_norm = torch.nn.utils.get_total_norm([p.grad for p in dense.parameters()])

    # The trainer: forward and backward in the spmd context, then the clip outside it.
    with get_spmd_context(parallel_dims=dims)():
        model(x).square().sum().backward()
    kinds = sorted({type(p).__name__ + "/" + type(p.data).__name__ for p in model.parameters()})
    if fixed:
        local = torch.stack([p.grad.square().sum() for p in model.parameters()]).sum()
        dist.all_reduce(local)
        norm = local.sqrt()
    else:
        norm = clip_grad_norm_(list(model.parameters()), max_norm=1e9)  # no clipping: just the norm it uses
    out.put((rank, float(norm), float(dense_norm), kinds))
    dist.destroy_process_group()


def main() -> int:
    fixed = "--fixed" in sys.argv
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=worker, args=(r, init, fixed, queue)) for r in range(TP)]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(60)
    bad = False
    for rank, norm, dense, kinds in results:
        print(f"rank {rank}: norm the clip uses {norm:.6f}, dense norm {dense:.6f} (parameters: {', '.join(kinds)})")
        bad |= abs(norm - dense) > 1e-9 * dense
    print("DEFECT: each rank clips by its own local norm" if bad else "OK: every rank uses the dense norm")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
