"""Repro: cohere with use_qk_norm=True (Command R+'s setting) -- tp_plan="auto" crashes in the first forward.

CohereAttention's q_norm / k_norm are CohereLayerNorm((num_heads, head_dim)): a weight per head. The plan shards
q_proj / k_proj colwise, so each rank holds num_heads / tp heads, but leaves the norms' per-head weights whole:
the norm multiplies this rank's heads by every head's weight (broadcast over a single local head it makes
num_heads of them; over several it raises), and the o_proj rowwise shard then gets the wrong width
("mat1 and mat2 shapes cannot be multiplied"). The plan holds only for use_qk_norm=False, the config default.
Fix: keep attention replicated (tp_plan override "replicate" on q/k/v/o_proj); the MLP rules stay.

Plain torch.distributed on gloo, 2 processes, no tpsim. The tensor-parallel model is sharded by transformers'
own code as ``from_pretrained(tp_plan="auto")`` shards it: the model's resolved plan
(``_resolve_parallel_plans``) applied by ``apply_tensor_parallelism`` to a model holding the same weights on
every rank (a fix that is a plan change goes through ``DistributedConfig(tp_plan={...})``, as a user passes it).

Run: python tests/wild/transformers_cohere_qk_norm_crash.py
Prints, for the plan as shipped and for the fix, the max relative error (TP vs dense, float64) of the output
and of the parameter grads it names. Exit code 0 when the shipped plan shows the defect and the fix removes it.
"""
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WS = 2
FIX = {'tp_plan': {'layers.*.self_attn.q_proj': 'replicate', 'layers.*.self_attn.k_proj': 'replicate', 'layers.*.self_attn.v_proj': 'replicate', 'layers.*.self_attn.o_proj': 'replicate'}}
DTYPE = torch.float64


def tiny_config():
    from transformers.models.cohere.configuration_cohere import CohereConfig

    return CohereConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
                        vocab_size=64, max_position_embeddings=128, num_hidden_layers=2, use_qk_norm=True)


def model_class():
    from transformers.models.cohere import modeling_cohere

    return modeling_cohere.CohereModel


def make_inputs(cfg):
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1234))
    return {"input_ids": ids}


def patch_code():
    """Code change of the fix (when the fix is not a plan change)."""
    pass


def fill(model):
    # deterministic weights that depend only on the parameter name; torch.empty params (experts, routers) included
    import hashlib

    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little"))
            if p.ndim >= 2:
                v = torch.randn(p.shape, generator=g, dtype=torch.float64) / p.shape[-1] ** 0.5
            elif name.endswith("bias"):
                v = 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64)
            else:
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(v.to(p.dtype))


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run(rank, port, mode, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WS))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    from torch.distributed.tensor import DTensor
    from transformers.distributed.configuration_utils import DistributedConfig

    dist.init_process_group("gloo", rank=rank, world_size=WS)
    if mode == "fix" and FIX.get("code"):
        patch_code()
    cfg = tiny_config()
    cls = model_class()
    torch.manual_seed(0)
    # built in the model's dtype as from_pretrained(dtype=...) builds it: parameters a module makes in a dtype of
    # its own (a router in float32) and the modules the class keeps in float32 stay so
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        src = cls(cfg)
    finally:
        torch.set_default_dtype(previous)
    keep = getattr(src, "_keep_in_fp32_modules", None) or []
    for name, module in src.named_modules():
        if any(k in name.split(".") for k in keep):
            module.float()
    fill(src)
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    cfg._attn_implementation = "eager"
    if hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = "eager"
    dense, tp = copy.deepcopy(src).eval(), copy.deepcopy(src).eval()
    plan = FIX["tp_plan"] if mode == "fix" and FIX.get("tp_plan") else "auto"
    resolved, _, _ = tp._resolve_parallel_plans(DistributedConfig(tp_plan=plan, tp_size=WS))
    apply_tensor_parallelism(tp, init_device_mesh("cpu", (WS,)), resolved)
    inputs = make_inputs(cfg)
    err = {}
    try:
        out_d = dense(**inputs, use_cache=False)
        out_d = out_d.logits if getattr(out_d, "logits", None) is not None else out_d.last_hidden_state
        out_t = tp(**inputs, use_cache=False)
        out_t = out_t.logits if getattr(out_t, "logits", None) is not None else out_t.last_hidden_state
        if isinstance(out_t, DTensor):
            out_t = out_t.full_tensor()
        err["output"] = rel(out_t, out_d)
        g = torch.randn(out_d.shape, generator=torch.Generator().manual_seed(99), dtype=out_d.dtype)
        (out_d * g).sum().backward()
        (out_t * g).sum().backward()
        dense_p = dict(dense.named_parameters())
        worst = 0.0
        for n, p in tp.named_parameters():
            gt = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            gd = dense_p[n].grad
            if gt is None or gd is None:
                continue
            e = rel(gt, gd)
            worst = max(worst, e)
            if any(s in n for s in ('q_norm', 'k_norm')):
                err[f"grad {n}"] = e
        err["worst grad"] = worst
    except Exception as e:  # noqa: BLE001 - the crash is the finding
        err["crash"] = f"{type(e).__name__}: {str(e)[:300]}"
    if rank == 0:
        q.put(err)
    dist.destroy_process_group()


def main():
    results = {}
    for mode in ("shipped", "fix"):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        mp.start_processes(run, args=(port, mode, q), nprocs=WS, join=True, start_method="spawn")
        results[mode] = q.get()
        print(f"== {mode} plan:")
        for k, v in results[mode].items():
            print(f"   {k}: {v if isinstance(v, str) else f'{v:.3e}'}")

    def bad(r):
        # defects are O(0.1-1); float32-kept modules (routers, norms) leave ~1e-6
        return "crash" in r or max(v for v in r.values() if isinstance(v, float)) > (1e-4 if DTYPE == torch.float64
                                                                                     else 1e-2)

    ok = bad(results["shipped"]) and not bad(results["fix"])
    print("defect reproduced and fixed" if ok else "NOT as expected")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
