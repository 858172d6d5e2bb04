"""transformers 5.24.0: ``replicated_with_grad_allreduce`` all-reduces the *accumulated* grad after every
backward, so gradient accumulation over micro-batches counts the earlier micro-batches tp times.
Plain torch.distributed on gloo, 2 processes, no tpsim.

The style (``ReplicatedWithGradAllReduce`` in ``transformers/distributed/tensor_parallel.py``) is the plan
of per-head q/k norms (Qwen3, Gemma3, OLMo2, ...) and other replicated parameters used on sharded
activations: on the first grad-enabled forward it registers
``param.register_post_accumulate_grad_hook(lambda p: dist.all_reduce(p.grad))``. That hook runs after
the fresh grad has been *added* to ``p.grad``; with two micro-batches before the optimizer step (what
``gradient_accumulation_steps`` does) the second backward all-reduces ``sum(g1) + g2_local`` and leaves
``tp * sum(g1) + sum(g2)``: the dense accumulated grad plus ``(tp - 1)`` times the first micro-batch's.
One micro-batch per step is right.

Run: python tests/wild/transformers_grad_allreduce_accumulation.py   (prints the errors, exits 1 on the defect)
The fix (``--fixed``): reduce only the fresh micro-batch's grad, with a tensor hook on the parameter
(``param.register_hook(lambda g: all_reduce(g))``) in place of the post-accumulate hook; the accumulated
grad is then the dense one (exit 0).
"""

import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TP = 2
MICRO_BATCHES = 2


def tiny_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, num_hidden_layers=1, vocab_size=64, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)  # the same weights on every rank
    model = Qwen3ForCausalLM(config).to(torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norm weights away from 1, so their grads are not special
                p.add_(0.1 * torch.randn(p.shape, dtype=p.dtype))
    return model


def fixed_install_forward(self, module, mesh):
    """ReplicatedWithGradAllReduce.install_forward with the grad reduced before it is accumulated."""
    original_forward = module.forward
    hooked = {}

    def tp_forward(*args, **kwargs):
        if torch.is_grad_enabled():
            for name, param in module.named_parameters(recurse=False):
                if param.requires_grad and hooked.get(name) is not param:
                    param.register_hook(lambda g: _reduced(g, mesh))
                    hooked[name] = param
        return original_forward(*args, **kwargs)

    module.forward = tp_forward
    return module


def _reduced(grad, mesh):
    grad = grad.clone()
    dist.all_reduce(grad, group=mesh.get_group())
    return grad


def run(rank, port, fixed, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(TP))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers.distributed import tensor_parallel
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    dist.init_process_group("gloo", rank=rank, world_size=TP)
    if fixed:
        tensor_parallel.ReplicatedWithGradAllReduce.install_forward = fixed_install_forward
    dense, tp = tiny_model(), tiny_model()
    # What from_pretrained(tp_plan="auto") applies: the model's resolved plan, by transformers' own code.
    plan, _, _ = tp._resolve_parallel_plans(DistributedConfig(tp_plan="auto", tp_size=TP))
    apply_tensor_parallelism(tp, init_device_mesh("cpu", (TP,)), plan)
    gen = torch.Generator().manual_seed(1)
    for _ in range(MICRO_BATCHES):  # gradient accumulation: no zero_grad between the micro-batches
        ids = torch.randint(0, 64, (2, 5), generator=gen)
        weights = torch.randn(2, 5, 64, generator=gen, dtype=torch.float64)
        for model in (dense, tp):
            logits = model(input_ids=ids, use_cache=False).logits
            logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
            (logits * weights).sum().backward()
    dense_params = dict(dense.named_parameters())
    errors = {}
    for name, p in tp.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = dense_params[name].grad
        errors[name] = float((grad - want).abs().max() / want.abs().max())
    if rank == 0:
        queue.put(errors)
    dist.destroy_process_group()


def main():
    fixed = "--fixed" in sys.argv
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(run, args=(port, fixed, queue), nprocs=TP, join=True, start_method="spawn")
    errors = queue.get()
    for name, err in errors.items():
        if "norm" in name or err > 1e-9:
            print(f"{name}: grad after {MICRO_BATCHES} micro-batches, max error relative to the dense grad {err:.3g}")
    # float64, a few dozen terms per sum: a correct grad agrees to ~1e-15; the defect is O(0.1-1)
    bad = [n for n, e in errors.items() if e > 1e-9]
    if bad:
        print(f"DEFECT: the accumulated grads of {', '.join(bad)} are reduced again after every micro-batch")
        sys.exit(1)
    print("every accumulated grad equals the dense one")


if __name__ == "__main__":
    main()
