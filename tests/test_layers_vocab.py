"""VocabParallelEmbedding and the vocab-parallel cross-entropies against their float64 dense twins.

The oracle is written out here: ``F.embedding`` and ``F.cross_entropy`` in float64 on the very
values the ranks saw (drawn in float64, rounded to the case's dtype), and the expected shard of
each rank is computed here from the vocabulary split (rank ``r`` owns ids ``[r*Vp/ws,
(r+1)*Vp/ws)`` of the vocabulary padded to ``Vp``), not by the layer's own ``shard``.

Tolerances are derived from the computation, never tuned:

- the embedding's forward copies rows and adds exact zeros, so it must be *bit-identical* to the
  dense lookup; its weight gradient sums the upstream rows of every occurrence of an id
  (``test_layers.tolerance`` with the number of tokens as the reduction length);
- the cross-entropy computes in ``c = promote(dtype, float32)`` with unit roundoff ``u_c``: the
  normaliser is a sum of ``V`` positive terms (relative error <= ``(V + ws + 2) u_c``) and the
  target and mean logits are exact shifted values, so per token
  ``|loss - ref| <= (V + ws + 4) u_c (1 + log Z + |x_t - m| + eps * mean|x_j - m|) + u |loss|``
  (``u`` the dtype's eps: the final rounding); each gradient entry ``p_j - (1-eps)[j=t] - eps/V`` has
  ``p_j``'s relative error plus two roundings to the dtype.

Every mutant of :mod:`tpsim.mutants.vocab` is run too and must differ from the dense result in
exactly the way its diagnosis says.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import assert_errors_before_any_collective, errors_raised
from test_layers import BACKENDS, DTYPES, assert_within, tolerance
from torch import nn

import tpsim
from tpsim.layers import (
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    padded_vocab_size,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
)
from tpsim.layers.vocab import CrossEntropySteps
from tpsim.mutants import vocab as vocab_mutants

WORLD_SIZES = [1, 2, 3, 4, 8]
DIM = 6


def vocab_sizes(ws: int) -> list[int]:
    """One vocabulary that divides by ``ws`` and two that do not (one padding row, and ws-1 of them)."""
    sizes = {3 * ws, 3 * ws + 1, 4 * ws - 1} if ws > 1 else {5, 7}
    return sorted(sizes)


def padded(vocab: int, ws: int, multiple: int = 1) -> int:
    multiple *= ws
    return -(-vocab // multiple) * multiple


def boundary_ids(vocab: int, ws: int, multiple: int = 1) -> list[int]:
    """The first and last real id of every rank's shard, and 0 and vocab-1."""
    per_rank = padded(vocab, ws, multiple) // ws
    ids = {0, vocab - 1}
    for r in range(ws):
        for i in (r * per_rank, (r + 1) * per_rank - 1):
            if i < vocab:
                ids.add(i)
    return sorted(ids)


def draw_ids(g: torch.Generator, shape: tuple[int, ...], vocab: int, ws: int, multiple: int = 1) -> torch.Tensor:
    """Random ids with every shard boundary among the first ones."""
    ids = torch.randint(0, vocab, shape, generator=g)
    flat = ids.view(-1)
    edges = torch.tensor(boundary_ids(vocab, ws, multiple))[: flat.numel()]
    flat[: edges.numel()] = edges
    return ids


def shard_rows(full: torch.Tensor, ws: int, rank: int, multiple: int = 1) -> torch.Tensor:
    """Rank ``rank``'s rows of a ``[V, ...]`` tensor padded with zero rows to ``Vp`` (written out here)."""
    vp = padded(full.shape[0], ws, multiple)
    pad = full.new_zeros(vp - full.shape[0], *full.shape[1:])
    return torch.cat([full, pad]).chunk(ws, dim=0)[rank]


# ================================================================== the embedding


def embedding_case(ws, vocab, *, dtype="float64", batch=(3, 5), seed=0, multiple=1) -> dict:
    return {"ws": ws, "vocab": vocab, "dtype": dtype, "batch": tuple(batch), "seed": seed, "multiple": multiple}


def make_embedding_data(case: dict) -> dict:
    g = torch.Generator().manual_seed(case["seed"])
    dt = DTYPES[case["dtype"]]
    return {
        "table": torch.randn(case["vocab"], DIM, generator=g, dtype=torch.float64).to(dt),
        "ids": draw_ids(g, case["batch"], case["vocab"], case["ws"], case["multiple"]),
        "gy": torch.randn(*case["batch"], DIM, generator=g, dtype=torch.float64).to(dt),
    }


def run_embedding_case(case: dict, cls=VocabParallelEmbedding) -> dict:
    data = make_embedding_data(case)
    dense = nn.Embedding(case["vocab"], DIM, dtype=DTYPES[case["dtype"]])
    with torch.no_grad():
        dense.weight.copy_(data["table"])
    layer = cls.from_dense(dense, padding_multiple=case["multiple"])
    y = layer(data["ids"])
    y.backward(data["gy"])
    return {"y": y.detach(), "gw": layer.weight.grad.clone(), "weight": layer.weight.detach().clone(),
            "padded": layer.padded_num_embeddings, "range": (layer.vocab_start_index, layer.vocab_end_index)}


def rank_embedding_cases(cases: list[dict]) -> list[dict]:
    return [run_embedding_case(c) for c in cases]


def embedding_oracle(case: dict) -> dict:
    data = make_embedding_data(case)
    table = data["table"].double().requires_grad_()
    y = F.embedding(data["ids"], table)
    y.backward(data["gy"].double())
    tokens = data["ids"].numel()
    magnitude = torch.zeros(case["vocab"], DIM, dtype=torch.float64).index_add_(
        0, data["ids"].reshape(-1), data["gy"].double().abs().reshape(-1, DIM))
    gw_tol = tolerance(magnitude, tokens, case["ws"], DTYPES[case["dtype"]])
    return {"y": y.detach(), "gw": table.grad, "gw_tol": gw_tol, "table": data["table"]}


def check_embedding(case: dict, per_rank: list[dict]) -> None:
    ws, dt = case["ws"], DTYPES[case["dtype"]]
    oracle = embedding_oracle(case)
    for rank, got in enumerate(per_rank):
        what = f"rank {rank} of {case}"
        # rows copied, exact zeros added: bit-identical to the dense lookup in the case's dtype
        assert got["y"].dtype == dt and torch.equal(got["y"], oracle["y"].to(dt)), f"output on {what}"
        assert got["padded"] == padded(case["vocab"], ws, case["multiple"]), what
        assert torch.equal(got["weight"], shard_rows(oracle["table"], ws, rank, case["multiple"])), f"shard on {what}"
        expected = shard_rows(oracle["gw"], ws, rank, case["multiple"])
        tol = shard_rows(oracle["gw_tol"], ws, rank, case["multiple"])
        assert_within(got["gw"], expected, tol, f"weight grad on {what}")
        assert torch.equal(got["y"], per_rank[0]["y"]), f"output differs between rank 0 and {rank}"


def embedding_cases(ws: int, dtypes=("float64",)) -> list[dict]:
    cases = []
    for seed, vocab in enumerate(vocab_sizes(ws)):
        for dtype in dtypes:
            cases.append(embedding_case(ws, vocab, dtype=dtype, seed=seed))
    cases.append(embedding_case(ws, vocab_sizes(ws)[0], batch=(7,), multiple=4, seed=11))  # Megatron's multiple
    cases.append(embedding_case(ws, vocab_sizes(ws)[-1], batch=(), seed=12))  # one id
    return cases


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_embedding_matches_dense_inproc(ws):
    """Forward bit-identical to nn.Embedding; each rank's weight grad is its rows of the dense grad
    (padding rows: zero); the output is the same bits on every rank. Divisible and padded vocabularies."""
    cases = embedding_cases(ws, dtypes=("float64", "float32", "bfloat16"))
    per_rank = tpsim.run(rank_embedding_cases, ws, args=(cases,))
    for i, case in enumerate(cases):
        check_embedding(case, [per_rank[r][i] for r in range(ws)])


@pytest.mark.gloo
@pytest.mark.parametrize("ws", [2, 3])
def test_embedding_matches_dense_gloo(ws):
    cases = embedding_cases(ws, dtypes=("float64", "bfloat16"))
    per_rank = tpsim.run(rank_embedding_cases, ws, backend="gloo", args=(cases,))
    for i, case in enumerate(cases):
        check_embedding(case, [per_rank[r][i] for r in range(ws)])


def test_padded_vocab_size_is_megatrons():
    # GPT-2's 50257 ids with make-vocab-size-divisible-by 128 at tp 2: a multiple of 256
    assert padded_vocab_size(50257, 2, 128) == 50432
    assert padded_vocab_size(32000, 2) == 32000
    assert padded_vocab_size(50257, 2) == 50258
    assert padded_vocab_size(5, 4) == 8  # the padding spans two ranks: [4, 6) holds id 4 only, [6, 8) none


def rank_embedding_init(seed: int, vocab: int) -> dict:
    torch.manual_seed(seed)
    dense = nn.Embedding(vocab, DIM)
    torch.manual_seed(seed)
    layer = VocabParallelEmbedding(vocab, DIM)
    back = layer.to_dense()
    again = VocabParallelEmbedding.from_dense(back)
    return {"init": torch.equal(back.weight, dense.weight), "round_trip": torch.equal(again.weight, layer.weight),
            "state": {k: tuple(v.shape) for k, v in layer.state_dict().items()}}


@pytest.mark.parametrize(("backend", "ws"), [("inproc", 1), ("inproc", 3), pytest.param("gloo", 2, marks=pytest.mark.gloo)])
def test_embedding_init_is_the_seeded_nn_embedding(backend, ws):
    vocab = 3 * ws + 1
    for rank, got in enumerate(tpsim.run(rank_embedding_init, ws, backend=backend, args=(5, vocab))):
        assert got["init"] and got["round_trip"], f"rank {rank}: {got}"
        assert got["state"] == {"weight": (padded(vocab, ws) // ws, DIM)}


# ================================================================== the cross-entropy


def ce_case(ws, vocab, *, dtype="float64", smoothing=0.0, ignore_index=-100, reduction="none", batch=(3, 4),
            seed=0, linear=False) -> dict:
    return {"ws": ws, "vocab": vocab, "dtype": dtype, "smoothing": smoothing, "ignore_index": ignore_index,
            "reduction": reduction, "batch": tuple(batch), "seed": seed, "linear": linear}


#: Padding columns hold large logits: an implementation that lets them into the softmax is far off.
PADDING_LOGIT = 30.0


def make_ce_data(case: dict) -> dict:
    """Full padded logits (or hidden states and a classifier), targets with boundaries and ignored ones."""
    g = torch.Generator().manual_seed(case["seed"])
    dt = DTYPES[case["dtype"]]
    ws, vocab, batch = case["ws"], case["vocab"], case["batch"]
    vp = padded(vocab, ws)
    # scale 3: the ranks' maxima differ, so a missing MAX all-reduce shows
    logits = (torch.randn(*batch, vp, generator=g, dtype=torch.float64) * 3).to(dt)
    logits[..., vocab:] = PADDING_LOGIT
    target = draw_ids(g, batch, vocab, ws)
    if target.numel() > 2:
        target.view(-1)[-1] = case["ignore_index"]
    data = {"logits": logits, "target": target, "gy": (torch.rand(batch, generator=g, dtype=torch.float64) + 0.5).to(dt)}
    if case["linear"]:
        data["hidden"] = torch.randn(*batch, DIM, generator=g, dtype=torch.float64).to(dt)
        data["weight"] = torch.randn(vocab, DIM, generator=g, dtype=torch.float64).to(dt)
    return data


def _local(full: torch.Tensor, ws: int, rank: int) -> torch.Tensor:
    return full.chunk(ws, dim=-1)[rank]


def run_ce_case(case: dict, fn=vocab_parallel_cross_entropy) -> dict:
    ws, rank = dist.get_world_size(), dist.get_rank()
    data = make_ce_data(case)
    kwargs = {"vocab_size": case["vocab"], "reduction": case["reduction"]}
    if case["linear"]:
        hidden = data["hidden"].clone().requires_grad_()
        weight = shard_rows(data["weight"], ws, rank).clone().requires_grad_()
        loss = fn(hidden, weight, data["target"], case["smoothing"], case["ignore_index"], **kwargs)
    else:
        logits = _local(data["logits"], ws, rank).clone().requires_grad_()
        loss = fn(logits, data["target"], case["smoothing"], case["ignore_index"], **kwargs)
    gy = data["gy"] if case["reduction"] == "none" else torch.ones((), dtype=loss.dtype)
    loss.backward(gy)
    out = {"loss": loss.detach()}
    if case["linear"]:
        out["g_hidden"], out["g_weight"] = hidden.grad, weight.grad
    else:
        out["g_logits"] = logits.grad
    return out


def rank_ce_cases(cases: list[dict], fn_name: str = "") -> list[dict]:
    fn = getattr(vocab_mutants, fn_name) if fn_name else None
    results = []
    for case in cases:
        default = vocab_parallel_linear_cross_entropy if case["linear"] else vocab_parallel_cross_entropy
        results.append(run_ce_case(case, fn or default))
    return results


def dense_ce(case: dict, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                           label_smoothing=case["smoothing"], ignore_index=case["ignore_index"],
                           reduction=case["reduction"])
    return loss.reshape(target.shape) if case["reduction"] == "none" else loss


def ce_oracle(case: dict) -> dict:
    """F.cross_entropy in float64 and the derived tolerance of the loss and of every gradient."""
    data = make_ce_data(case)
    ws, vocab, eps_s = case["ws"], case["vocab"], case["smoothing"]
    dt = DTYPES[case["dtype"]]
    u, u_c = torch.finfo(dt).eps, torch.finfo(torch.promote_types(dt, torch.float32)).eps
    target, ignored = data["target"], data["target"] == case["ignore_index"]
    out: dict = {}
    if case["linear"]:
        hidden = data["hidden"].double().requires_grad_()
        weight = data["weight"].double().requires_grad_()
        x = F.linear(hidden, weight)
    else:
        x = data["logits"][..., :vocab].double().requires_grad_()
    loss = dense_ce(case, x, target)
    gy = data["gy"].double() if case["reduction"] == "none" else torch.ones((), dtype=torch.float64)
    loss.backward(gy)
    xs = x.detach()
    m = xs.amax(-1, keepdim=True)
    shifted = (xs - m).abs()
    log_z = torch.logsumexp(xs - m, -1)
    t_safe = target.masked_fill(ignored, 0)
    picked = shifted.gather(-1, t_safe.unsqueeze(-1)).squeeze(-1)
    k = vocab + ws + 4
    if case["linear"]:
        # the logits themselves are a dot product of length DIM computed in the dtype
        logit_err = tolerance(data["hidden"].double().abs() @ data["weight"].double().abs().T, DIM, ws, dt)
        k_logit = logit_err.amax(-1)  # a logit error shifts log Z and the picked logit by at most this
    else:
        k_logit = torch.zeros_like(log_z)
    per_token = (k * u_c * (1 + log_z + picked + eps_s * shifted.mean(-1)) + 2 * k_logit).masked_fill(ignored, 0.0)
    ref = loss.detach()
    if case["reduction"] == "none":
        out["loss"] = (ref, per_token + u * ref.abs())
    else:
        count = 1 if case["reduction"] == "sum" else max(int((~ignored).sum()), 1)
        token_losses = dense_ce({**case, "reduction": "none"}, xs, target).abs()
        n = target.numel()
        out["loss"] = (ref, (per_token.sum() + (n + 2) * u * token_losses.sum()) / count + u * ref.abs())
    # gradient of the logits: (p_j - (1-eps)[j=t] - eps/V) * upstream
    p = torch.softmax(xs, -1)
    onehot = F.one_hot(t_safe, vocab).double()
    upstream = (gy / (1 if case["reduction"] != "mean" else max(int((~ignored).sum()), 1))).expand(target.shape)
    magnitude = (p + (1 - eps_s) * onehot + eps_s / vocab) * upstream.abs().unsqueeze(-1)
    g_logits = (p - (1 - eps_s) * onehot - eps_s / vocab) * upstream.unsqueeze(-1)
    # a logit error dx moves p_j by at most p_j * 2 max|dx| (the softmax's relative sensitivity)
    shift = 2 * k_logit.unsqueeze(-1) * p * upstream.abs().unsqueeze(-1)
    g_tol = (k * u_c * magnitude + shift + 3 * u * g_logits.abs()).masked_fill(ignored.unsqueeze(-1), 0.0)
    if case["linear"]:
        hd, wd = data["hidden"].double().abs(), data["weight"].double().abs()
        rows = target.numel()
        out["g_hidden"] = (hidden.grad, tolerance(magnitude @ wd, vocab, ws, dt) + (g_tol @ wd))
        flat_m, flat_t = magnitude.reshape(-1, vocab), g_tol.reshape(-1, vocab)
        hd2 = hd.reshape(-1, DIM)
        out["g_weight"] = (weight.grad, tolerance(flat_m.T @ hd2, rows, ws, dt) + flat_t.T @ hd2)
    else:
        pad = padded(vocab, ws) - vocab
        zeros = torch.zeros(*target.shape, pad, dtype=torch.float64)
        out["g_logits"] = (torch.cat([x.grad, zeros], -1), torch.cat([g_tol, zeros], -1))  # padding: exactly 0
    return out


def check_ce(case: dict, per_rank: list[dict]) -> None:
    ws, dt = case["ws"], DTYPES[case["dtype"]]
    oracle = ce_oracle(case)
    for rank, got in enumerate(per_rank):
        what = f"rank {rank} of {case}"
        ref, tol = oracle["loss"]
        assert got["loss"].dtype == dt, f"loss dtype {got['loss'].dtype} on {what}"
        if ref.isnan().all():  # reduction="mean" with every target ignored: NaN, as F.cross_entropy
            assert got["loss"].isnan().all(), f"loss on {what}"
        else:
            assert_within(got["loss"], ref, tol, f"loss on {what}")
        if case["linear"]:
            assert_within(got["g_hidden"], *oracle["g_hidden"], f"hidden grad on {what}")
            full, tol = oracle["g_weight"]
            assert_within(got["g_weight"], shard_rows(full, ws, rank), shard_rows(tol, ws, rank), f"weight grad on {what}")
            assert torch.equal(got["g_hidden"], per_rank[0]["g_hidden"]), f"hidden grad differs, rank 0 vs {rank}"
        else:
            full, tol = oracle["g_logits"]
            assert_within(got["g_logits"], _local(full, ws, rank), _local(tol, ws, rank), f"logits grad on {what}")
        assert torch.equal(got["loss"], per_rank[0]["loss"]), f"loss differs between rank 0 and {rank}: {case}"


def ce_cases(ws: int, dtypes=("float64",), linear=False) -> list[dict]:
    cases = []
    seed = 0
    for vocab in vocab_sizes(ws):
        for smoothing, ignore_index, reduction in ((0.0, -100, "none"), (0.1, -100, "none"), (0.3, 1, "mean"),
                                                   (1.0, -1, "sum"), (0.0, vocab - 1, "mean")):
            for dtype in dtypes:
                seed += 1
                cases.append(ce_case(ws, vocab, dtype=dtype, smoothing=smoothing, ignore_index=ignore_index,
                                     reduction=reduction, seed=seed, linear=linear))
    cases.append(ce_case(ws, vocab_sizes(ws)[0], batch=(), seed=99, linear=linear))  # one token
    cases.append(ce_case(ws, vocab_sizes(ws)[0], batch=(2,), ignore_index=0, reduction="mean", seed=98,
                         linear=linear))
    return cases


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_cross_entropy_matches_dense_inproc(ws):
    """Per-token and reduced loss equal F.cross_entropy (label smoothing, ignore_index, padded vocab),
    each rank's logits grad is its shard of the dense grad (padding columns: exactly 0), the loss is
    the same bits on every rank."""
    cases = ce_cases(ws, dtypes=("float64", "float32", "bfloat16"))
    per_rank = tpsim.run(rank_ce_cases, ws, args=(cases,))
    for i, case in enumerate(cases):
        check_ce(case, [per_rank[r][i] for r in range(ws)])


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_linear_cross_entropy_matches_dense_inproc(ws):
    """The output layer + loss: the hidden-state grad is complete and identical on every rank."""
    cases = ce_cases(ws, dtypes=("float64", "float32"), linear=True)
    per_rank = tpsim.run(rank_ce_cases, ws, args=(cases,))
    for i, case in enumerate(cases):
        check_ce(case, [per_rank[r][i] for r in range(ws)])


def rank_steps_cases(cases: list[dict]) -> list[dict]:
    return [run_ce_case(case, CrossEntropySteps()) for case in cases]


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_the_steps_under_autograd_are_the_loss(ws):
    """CrossEntropySteps, the base of the cross-entropy mutants, called (autograd through the very
    forward the loss function runs) is that function: the same loss bits, and gradients within the
    dense oracle's tolerance; so a mutant differs from the correct loss only by the step it overrides."""
    cases = ce_cases(ws, dtypes=("float64", "float32", "bfloat16"))
    steps = tpsim.run(rank_steps_cases, ws, args=(cases,))
    function = tpsim.run(rank_ce_cases, ws, args=(cases,))
    for i, case in enumerate(cases):
        check_ce(case, [steps[r][i] for r in range(ws)])
        for rank in range(ws):
            torch.testing.assert_close(steps[rank][i]["loss"], function[rank][i]["loss"], rtol=0, atol=0,
                                       equal_nan=True, msg=lambda m, case=case: f"{case}: {m}")


@pytest.mark.gloo
@pytest.mark.parametrize("ws", [2, 3])
def test_cross_entropy_matches_dense_gloo(ws):
    cases = ce_cases(ws, dtypes=("float64", "bfloat16"))[::2] + ce_cases(ws, linear=True)[::3]
    per_rank = tpsim.run(rank_ce_cases, ws, backend="gloo", args=(cases,))
    for i, case in enumerate(cases):
        check_ce(case, [per_rank[r][i] for r in range(ws)])


def test_cross_entropy_all_ignored_mean_is_nan_like_torch():
    case = ce_case(2, 6, reduction="mean", ignore_index=-100, batch=(3,))

    def rank_fn():
        logits = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
        target = torch.full((3,), -100)
        return vocab_parallel_cross_entropy(logits, target, reduction="mean").item()

    assert all(math.isnan(v) for v in tpsim.run(rank_fn, case["ws"]))
    assert math.isnan(F.cross_entropy(torch.randn(3, 6), torch.full((3,), -100)).item())


def rank_module_round_trip() -> dict:
    dense = nn.CrossEntropyLoss(ignore_index=3, reduction="sum", label_smoothing=0.2)
    module = VocabParallelCrossEntropy.from_dense(dense, vocab_size=7)
    back = module.to_dense()
    logits = torch.randn(4, 8, dtype=torch.float64).chunk(dist.get_world_size(), -1)[dist.get_rank()]
    target = torch.tensor([0, 3, 6, 2])
    return {"back": (back.ignore_index, back.reduction, back.label_smoothing),
            "same": torch.equal(module(logits, target), vocab_parallel_cross_entropy(
                logits, target, 0.2, 3, vocab_size=7, reduction="sum"))}


def test_cross_entropy_module_is_nn_cross_entropy_loss():
    for got in tpsim.run(rank_module_round_trip, 2):
        assert got == {"back": (3, "sum", 0.2), "same": True}


# ================================================================== errors


def _ce(logits_shape=(2, 4), target=(0, 1), **kwargs):
    return vocab_parallel_cross_entropy(torch.zeros(logits_shape), torch.tensor(target), **kwargs)


ERROR_CASES = {
    "embedding-id-too-large": (lambda: VocabParallelEmbedding(6, 4)(torch.tensor([1, 6])), ValueError,
                               "VocabParallelEmbedding: input holds id 6, outside [0, vocab_size=6)"),
    "embedding-negative-id": (lambda: VocabParallelEmbedding(6, 4)(torch.tensor([-1])), ValueError,
                              "VocabParallelEmbedding: input holds id -1, outside [0, vocab_size=6)"),
    "embedding-float-ids": (lambda: VocabParallelEmbedding(6, 4)(torch.zeros(2)), TypeError,
                            "VocabParallelEmbedding: input must hold integer token ids (e.g. torch.long), "
                            "got dtype torch.float32"),
    "embedding-size": (lambda: VocabParallelEmbedding(0, 4), ValueError,
                       "VocabParallelEmbedding: num_embeddings=0 must be >= 1"),
    "embedding-padding-idx": (lambda: VocabParallelEmbedding.from_dense(nn.Embedding(6, 4, padding_idx=0)),
                              ValueError, "VocabParallelEmbedding.from_dense: padding_idx=0 is not supported; "
                              "use an nn.Embedding without it"),
    "embedding-from-dense-type": (lambda: VocabParallelEmbedding.from_dense(nn.Linear(2, 2)), TypeError,
                                  "VocabParallelEmbedding.from_dense: embedding must be a torch.nn.Embedding, "
                                  "got Linear"),
    "ce-target-shape": (lambda: _ce(target=(0, 1, 2)), ValueError,
                        "vocab_parallel_cross_entropy: target shape (3,) must be the logits' shape without the "
                        "vocab dim, (2,) (logits shape (2, 4))"),
    "ce-target-range": (lambda: _ce(target=(0, 9)), ValueError,
                        "vocab_parallel_cross_entropy: target holds id 9, outside [0, vocab_size=8) "
                        "(or ignore_index=-100)"),
    "ce-target-float": (lambda: vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2)), TypeError,
                        "vocab_parallel_cross_entropy: target must hold integer token ids (e.g. torch.long), "
                        "got dtype torch.float32"),
    "ce-smoothing": (lambda: _ce(label_smoothing=1.5), ValueError,
                     "vocab_parallel_cross_entropy: label_smoothing=1.5 must be a float in [0, 1]"),
    "ce-reduction": (lambda: _ce(reduction="avg"), ValueError,
                     "vocab_parallel_cross_entropy: reduction='avg' must be one of 'none', 'mean', 'sum'"),
    "ce-vocab-size": (lambda: _ce(vocab_size=9), ValueError,
                      "vocab_parallel_cross_entropy: vocab_size=9 is more than the 8 ids the logits hold "
                      "(4 columns per rank on 2 rank(s))"),
    "ce-int-logits": (lambda: vocab_parallel_cross_entropy(torch.zeros(2, 4, dtype=torch.long), torch.tensor([0, 1])),
                      TypeError, "vocab_parallel_cross_entropy: logits must be a floating-point torch.Tensor "
                      "(this rank's vocab shard), got a tensor of dtype torch.int64"),
    "linear-ce-shapes": (lambda: vocab_parallel_linear_cross_entropy(torch.zeros(2, 3), torch.zeros(4, 5),
                                                                     torch.tensor([0, 1])), ValueError,
                         "vocab_parallel_linear_cross_entropy: expected hidden [..., D] and weight "
                         "[vocab/world_size, D], got hidden shape (2, 3) and weight shape (4, 5)"),
}


def rank_errors(names: list[str]) -> dict:
    return errors_raised(ERROR_CASES, names)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_error_on_every_rank_before_any_collective(backend):
    result = tpsim.run_world(rank_errors, 2, backend=backend, args=(list(ERROR_CASES),))
    assert_errors_before_any_collective(result, ERROR_CASES, 2)


# ================================================================== the mutants differ as diagnosed


def rank_embedding_mutant(case: dict) -> dict:
    return run_embedding_case(case, vocab_mutants.EmbeddingUnmaskedIds)


def test_unmasked_embedding_adds_every_other_ranks_first_row():
    """vocab-mask-missing: out[t] = E[t] + sum over the ranks not owning t of their first row."""
    ws = 3
    case = embedding_case(ws, 10)  # padded to 12: rows 0, 4, 8 start the shards
    got = tpsim.run(rank_embedding_mutant, ws, args=(case,))
    data = make_embedding_data(case)
    table, ids = data["table"].double(), data["ids"]
    per_rank = padded(10, ws) // ws
    owner = ids // per_rank
    firsts = table[[r * per_rank for r in range(ws)]]  # [ws, D]
    leak = firsts.sum(0) - firsts[owner]  # every rank's first row but the owner's
    expected = table[ids] + leak
    assert not torch.allclose(got[0]["y"], table[ids]), "the mutant should differ from nn.Embedding"
    assert_within(got[0]["y"], expected, tolerance(table[ids].abs() + firsts.abs().sum(0), ws, ws, torch.float64),
                  "unmasked embedding")


def _ce_mutant(name: str, case: dict) -> list[dict]:
    """Each rank's results of one case run through the mutant ``name``."""
    return [values[0] for values in tpsim.run(rank_ce_cases, case["ws"], args=([case], name))]


def _per_token(case: dict) -> dict:
    """float64 pieces of the dense loss: shifted logits, log Z, the target's logit, ignored mask."""
    data = make_ce_data(case)
    x = data["logits"].double()[..., : case["vocab"]]
    return {"x": x, "target": data["target"], "ignored": data["target"] == case["ignore_index"],
            "logits": data["logits"].double(), "ref": dense_ce({**case, "reduction": "none"}, x, data["target"])}


def test_smoothing_per_shard_gives_each_rank_its_own_loss():
    """label-smoothing-per-shard: rank r's loss uses the mean logit of its own shard only."""
    ws, eps = 2, 0.2
    case = ce_case(ws, 8, smoothing=eps)
    got = _ce_mutant("cross_entropy_smoothing_per_shard", case)
    d = _per_token(case)
    x, t = d["x"], d["target"].masked_fill(d["ignored"], 0)
    log_z = torch.logsumexp(x, -1)
    nll = log_z - x.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    for rank in range(ws):
        shard_mean = _local(x, ws, rank).mean(-1)
        expected = ((1 - eps) * nll + eps * (log_z - shard_mean)).masked_fill(d["ignored"], 0.0)
        assert_within(got[rank]["loss"], expected, 1e-12 * (1 + expected.abs()), f"rank {rank}")
    assert not torch.equal(got[0]["loss"], got[1]["loss"]), "the ranks' losses should differ"


def test_local_max_mixes_shifts():
    """max-not-reduced: the normaliser adds exp(x - m_r) with each rank's own maximum m_r."""
    ws = 2
    case = ce_case(ws, 8)
    got = _ce_mutant("cross_entropy_local_max", case)
    d = _per_token(case)
    x, t = d["x"], d["target"].masked_fill(d["ignored"], 0)
    shards = x.chunk(ws, -1)
    maxima = [s.amax(-1, keepdim=True) for s in shards]
    log_z = torch.log(sum((s - m).exp().sum(-1) for s, m in zip(shards, maxima, strict=True)))
    owner = t // (8 // ws)
    m_owner = torch.stack([m.squeeze(-1) for m in maxima], -1).gather(-1, owner.unsqueeze(-1)).squeeze(-1)
    expected = (log_z - (x.gather(-1, t.unsqueeze(-1)).squeeze(-1) - m_owner)).masked_fill(d["ignored"], 0.0)
    assert_within(got[0]["loss"], expected, 1e-12 * (1 + expected.abs()), "local max")
    assert (got[0]["loss"] - d["ref"]).abs().max() > 1e-3, "the mutant should differ from F.cross_entropy"


@pytest.mark.parametrize("smoothing", [0.0, 0.3])
@pytest.mark.parametrize("ws", [2, 4])
def test_gathered_logits_loss_is_off_by_log_tp(ws, smoothing):
    """loss-off-by-log-tp: every non-ignored token's loss is the dense one plus exactly log(ws)."""
    case = ce_case(ws, 3 * ws + 1, smoothing=smoothing)
    got = _ce_mutant("cross_entropy_gathered_logits", case)
    d = _per_token(case)
    expected = (d["ref"] + math.log(ws)).masked_fill(d["ignored"], 0.0)
    for rank in range(ws):
        assert_within(got[rank]["loss"], expected, 1e-12 * (1 + expected.abs()), f"rank {rank}")


def test_padding_in_softmax_only_shows_when_the_vocab_does_not_divide():
    """vocab-padding-in-softmax: the loss is the cross-entropy over the padded vocabulary."""
    ws = 2
    divisible = ce_case(ws, 8)
    got = _ce_mutant("cross_entropy_padding_in_softmax", divisible)
    assert_within(got[0]["loss"], _per_token(divisible)["ref"], 1e-12 * (1 + _per_token(divisible)["ref"].abs()),
                  "divisible vocab")
    case = ce_case(ws, 7)
    got = _ce_mutant("cross_entropy_padding_in_softmax", case)
    d = _per_token(case)
    over_padded = dense_ce({**case, "reduction": "none"}, d["logits"], d["target"])
    assert_within(got[0]["loss"], over_padded, 1e-12 * (1 + over_padded.abs()), "padded vocab")
    assert (got[0]["loss"] - d["ref"]).abs().max() > 1.0


def test_linear_cross_entropy_hidden_grad_is_each_ranks_summand():
    """grad-not-reduced: the ranks' hidden-state grads differ and add up to the dense grad."""
    ws = 3
    case = ce_case(ws, 10, linear=True)
    got = _ce_mutant("linear_cross_entropy_hidden_grad_not_reduced", case)
    oracle = ce_oracle(case)
    full, tol = oracle["g_hidden"]
    total = sum(g["g_hidden"] for g in got)
    assert_within(total, full, tol * ws, "sum of the ranks' hidden grads")
    assert not torch.equal(got[0]["g_hidden"], got[1]["g_hidden"])
    for rank in range(ws):  # the loss itself is right
        assert_within(got[rank]["loss"], *oracle["loss"], f"loss on rank {rank}")
