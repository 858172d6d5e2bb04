"""The linear family's world run of one case, and its float64 dense reference.

Every per-case property reads the same :class:`~tpsim.props.observation.Observation`: one world
run per case (:meth:`tpsim.props.linear.family.LinearFamily.world`), in which each
rank builds the variant from the master values and trains it as people train
(:func:`tpsim.props.rank.schedule`): two optimizer steps, the first accumulating the case's
``micro_batches`` micro-batches (plain ``backward()`` per micro-batch, no clearing in between, so grad
hooks fire as they do in training), the second one; SGD steps (:class:`tpsim.props.rank.SGD`) after the last
micro-batch of each, then ``zero_grad`` in the case's mode (``set_to_none``). It returns (as tensors)
its first micro-batch's output, input grad and parameter grads, the grads accumulated over the first
step's micro-batches and its final parameters, as one typed :class:`RankResult`. The comparison happens in the parent process
(:mod:`tpsim.props.linear.checks`), so the ranks do no extra collectives of their own — except the
trainer's: a replicated parameter whose grad is left partial (``ParamSpec(grad="partial")``, or
Megatron's ``param.sequence_parallel`` marker) has its grad summed over the tp group once per
optimizer step, after the accumulation, as Megatron's ``finalize_model_grads`` does — and the same code serves every backend.

A case whose sharded sizes do not divide runs the same steps (:func:`_uneven_rank`): the layer may
refuse it while it is built or in its first forward, or hold ``torch.tensor_split``'s (or
``torch.chunk``'s) pieces, which are then loaded and checked like a divisible case's
(:func:`tpsim.placement.uneven_pieces`). A
forward-only variant (an inference layer) runs one forward under ``torch.no_grad()``.

The rank function :func:`rank_main` is module-level and takes picklable arguments, so gloo/nccl
worker processes can run it; there the variant is resolved again from its target string
(:mod:`tpsim.props.rank`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tpsim.conventions import returned_bias
from tpsim.errors import InvalidArgument
from tpsim.placement import (
    UNEVEN_STYLES,
    Replicate,
    Shard,
    part_sizes,
    replica_expanded,
    replicated_parts,
    shard_shape,
    shard_tensor,
    uneven_pieces,
)
from tpsim.props.layouts import apply_layout, expand_values
from tpsim.props.linear.case import Case
from tpsim.props.observation import OK, RankOutput
from tpsim.props.rank import (
    LR,
    OPTIMIZER_STEPS,
    enter_rank,
    optimizer_of,
    rank_phase,
    schedule,
    total_micro_batches,
    trainer_step,
    zero_grad_of,
)
from tpsim.variant import LayoutError, Variant, get_param, load_master, stored_shape

__all__ = [
    "LR",
    "OPTIMIZER_STEPS",
    "Masters",
    "RankResult",
    "Reference",
    "expanded_out_features",
    "expanded_view",
    "is_divisible",
    "make_masters",
    "non_divisible_sizes",
    "rank_main",
    "reference",
    "replica_trained",
    "sum_kv_replicas",
]

#: :attr:`RankResult.status` of a non-divisible case that the layer built and ran without refusing it.
ACCEPTED = "accepted"


@dataclass
class RankResult(RankOutput):
    """What one rank returns for one case (plain data: it travels back from gloo/nccl workers).

    Besides :class:`~tpsim.props.observation.RankOutput`'s fields (``status`` is also
    :data:`ACCEPTED`; ``output`` is the step-0 output, a detached clone in its own dtype):

    - ``output_shape``: for :data:`ACCEPTED`, the shape of the output of a non-divisible case;
    - ``input_grad``: the first micro-batch's grad of the rank's input (None when it got none);
    - ``grads``: the parameter grads after the first micro-batch's backward, as the layer left them, by
      master name (``weight``/``bias``), in master layout (a transposed weight read back); None where
      ``.grad`` was None;
    - ``accumulated``: the parameter grads after the first optimizer step's micro-batches (before the
      trainer's sum), likewise;
    - ``summed_grads``: for the parameters in ``partial``, the first step's accumulated grad after the
      trainer's sum;
    - ``final``: the parameters after the last optimizer step, by master name, in master layout;
    - ``init``: the layer's own values of its replicated parameters right after construction, by
      parameter name (before the master values are loaded);
    - ``loaded``: the parameters the layer loaded itself (a spec with ``load=False``: its builder cut
      the masters), by master name, in master layout, as it held them right after construction;
    - ``partial``: master names of the parameters whose grad the trainer sums (declared partial, or
      marked ``sequence_parallel`` by the built module);
    - ``absent``: master names of the parameters this rank's layer does not hold (a parameter held by
      tp rank 0 only, see :attr:`tpsim.variant.ParamSpec.held_by`).
    """

    output_shape: tuple[int, ...] | None = None
    input_grad: torch.Tensor | None = None
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    accumulated: dict[str, torch.Tensor | None] = field(default_factory=dict)
    summed_grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    final: dict[str, torch.Tensor | None] = field(default_factory=dict)
    init: dict[str, torch.Tensor] = field(default_factory=dict)
    loaded: dict[str, torch.Tensor] = field(default_factory=dict)
    partial: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    #: The layer's forward returned a bias for the caller to add (``skip_bias_add``), which tpsim added.
    returned_bias: bool = False
    #: A non-divisible case the layer accepted with ``torch.tensor_split`` or ``torch.chunk`` pieces, run like
    #: a divisible one: ``pieces`` names the layout it was loaded and fed by, ``fits`` every layout its
    #: parameters' shapes fit (:data:`tpsim.placement.UNEVEN_STYLES`).
    uneven: bool = False
    pieces: str | None = None
    fits: tuple[str, ...] = ()


@dataclass
class Masters:
    """The master tensors of a case, in the case's dtype (drawn from its seed)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    inputs: list[torch.Tensor]
    grads: list[torch.Tensor]
    #: The per-step inputs and upstream grads of tp groups 1, 2, ... (``tp_size < world_size``);
    #: ``inputs``/``grads`` are group 0's. Every group shares the master weight and bias.
    groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=list)

    def for_group(self, group_index: int) -> Masters:
        """The masters tp group ``group_index`` sees (its own inputs and grads, the shared parameters)."""
        if group_index == 0:
            return Masters(self.weight, self.bias, self.inputs, self.grads)
        inputs, grads = self.groups[group_index - 1]
        return Masters(self.weight, self.bias, inputs, grads)


def make_masters(case: Case, grad_features: int | None = None) -> Masters:
    """Draw the master weight ``[out, in]``, bias ``[out]``, and per-micro-batch inputs ``[*batch, in]``
    and upstream grads ``[*batch, out]`` (:func:`~tpsim.props.rank.total_micro_batches`, in training
    order) from ``case.seed`` (float64 normal draws rounded to the dtype).
    ``grad_features``: the upstream grads' width when it is not ``out`` (replicated key/value heads:
    :func:`expanded_out_features`)."""
    gen = torch.Generator().manual_seed(case.seed)
    dtype = case.torch_dtype

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    weight = draw(case.out_features, case.in_features)
    bias = draw(case.out_features) if case.bias else None
    data = []
    # Group 0 first: its data is that of the same case with one tp group spanning the world.
    for _ in range(case.world_size // (case.tp_size or case.world_size)):
        inputs, grads = [], []
        for _ in range(total_micro_batches(case)):
            # An expanded layout needs rows that repeat along the first batch dim (tpsim.props.layouts).
            inputs.append(expand_values(draw(*case.batch_shape, case.in_features), case.input_layout))
            grads.append(expand_values(draw(*case.batch_shape, grad_features or case.out_features), case.input_layout))
        data.append((inputs, grads))
    return Masters(weight, bias, data[0][0], data[0][1], groups=data[1:])


def expanded_out_features(variant: Variant, case: Case) -> int | None:
    """The output width of a case whose packed weight holds replicated key/value heads at its tp size
    (``Variant.head_size`` with fewer key/value heads than ranks): every rank's output features side by
    side, ``tp * local``, so that each replica of a head has columns of its own (None: no replicas).

    Why a replica is its own column: the ranks holding one key/value head serve different query
    heads, so each gets its own upstream grad for it (in attention, the grad through its own query
    heads only). The dense twin of such a layer is therefore ``nn.Linear`` with the replica-expanded
    weight (:func:`tpsim.placement.replica_expanded`: the master's K/V rows repeated once per
    replica), run on upstream grads drawn at this width. Each rank's output, weight/bias grad and
    trained value is then exactly its own piece of that twin's (``Shard(-1)``/``Shard(0)`` of the
    expanded tensors), and, by the chain rule through the repeat, the master's grad of a key/value
    row is the *sum* of its replicas' grads: a replica's grad alone is its query heads' share. Who
    takes the sum is the parameter's ``ParamSpec.grad``: ``"partial"`` (vLLM), the trainer, before
    every SGD step (:func:`sum_kv_replicas`), each replica's grad being checked as its own share;
    ``"complete"`` (tpsim's own layer), the layer, each replica's grad being checked as the head's
    whole grad. Either way every replica trains like the master's head (:func:`replica_trained`)."""
    if not variant.packed or variant.head_size is None or variant.kind != "column":
        return None
    tp = case.tp_size or case.world_size
    placement = Shard(0, parts=variant.packed, head_size=variant.head_size)
    try:
        if not any(replicated_parts(case.out_features, placement, tp)):
            return None
        return tp * shard_shape((case.out_features, 1), placement, tp)[0]
    except InvalidArgument:
        return None


def expanded_view(variant: Variant, case: Case, masters: Masters) -> tuple[Variant, Case, Masters]:
    """The variant, case and masters the checks compare a replicated-key/value case against (see
    :func:`expanded_out_features`): the replica-expanded weight and bias, ``out_features`` the
    expanded width, and the variant's packed placements replaced by plain ``Shard(0)``/``Shard(-1)``
    (rank ``r``'s rows of the expanded weight are exactly what it holds). Unchanged without replicas."""
    width = expanded_out_features(variant, case)
    if width is None:
        return variant, case, masters
    tp = case.tp_size or case.world_size
    placement = Shard(0, parts=variant.packed, head_size=variant.head_size)
    weight = replica_expanded(masters.weight, placement, tp)
    bias = None if masters.bias is None else replica_expanded(masters.bias, placement, tp)
    # Plain shards of the expanded tensors; each rank's expected grad is set by the checks (grad rule).
    plain = variant.replace(packed=None, head_size=None, params=tuple(
        dataclasses.replace(s, placement=Shard(s.placement.dim), grad="complete") if isinstance(s.placement, Shard)
        else s for s in variant.params or ()))
    return plain, dataclasses.replace(case, out_features=width), Masters(weight, bias, masters.inputs, masters.grads,
                                                                           groups=masters.groups)


def _kv_layout(variant: Variant, case: Case) -> tuple[Shard, tuple[int, ...], tuple[bool, ...], int]:
    tp = case.tp_size or case.world_size
    placement = Shard(0, parts=variant.packed, head_size=variant.head_size)
    return placement, part_sizes(case.out_features, placement), replicated_parts(case.out_features, placement, tp), tp


def sum_kv_replicas(variant: Variant, case: Case, module: Any, specs: list[Any], group: Any, rank: int) -> None:
    """The trainer's sum, once per optimizer step after its micro-batches, of every replicated key/value head's weight and bias grad
    over the ranks holding it (see :func:`expanded_out_features`: each holds its own query heads' share;
    as ``grad="partial"`` is for a replicated parameter): one all-reduce per replicated part and
    parameter, of a ``[heads, head_size, ...]`` buffer holding this rank's share at its head's index
    (rank ``r``'s head by the declared layout, whatever the layer holds). Every rank joins every sum."""
    placement, parts, replicated, tp = _kv_layout(variant, case)
    d = variant.head_size or 1
    local = [d if rep else p // tp for p, rep in zip(parts, replicated, strict=True)]
    for spec in specs:
        if not isinstance(spec.placement, Shard) or spec.grad != "partial":
            continue  # a complete grad: the layer summed the shares itself
        p = get_param(module, spec.name)
        grad = None if p is None or p.grad is None else (p.grad.t() if spec.transposed and p.grad.dim() == 2 else p.grad)
        rest = () if spec.master == "bias" else (case.in_features,)
        usable = grad is not None and tuple(grad.shape) == (sum(local), *rest)
        for i, (size, rep) in enumerate(zip(parts, replicated, strict=True)):
            if not rep:
                continue
            heads, offset = size // d, sum(local[:i])
            head = rank * heads // tp
            dtype = grad.dtype if grad is not None else case.torch_dtype
            buf = torch.zeros(heads, d, *rest, dtype=dtype)
            if usable:
                buf[head] = grad[offset: offset + d]  # type: ignore[index]
            dist.all_reduce(buf, group=group)
            if usable:
                with torch.no_grad():
                    grad[offset: offset + d] = buf[head]  # type: ignore[index]


def replica_trained(variant: Variant, case: Case, masters: Masters, expanded: Masters) -> tuple[dict[str, torch.Tensor],
                                                                                                dict[str, torch.Tensor]]:
    """What every rank must hold, replica-expanded, once each replicated head's grad is complete (the
    replicas' shares summed, by the layer or by the trainer, :func:`sum_kv_replicas`), with their
    magnitudes: the grads (``dweight``, ``dbias``, accumulated ``acc_dweight``, ``acc_dbias``) and the trained parameters (``final_weight``,
    ``final_bias``) of dense SGD on the master parameters whose upstream grad of a key/value column is
    the sum of its replicas' upstream grads (the magnitudes from the sum of their absolute values)."""
    placement, _, _, tp = _kv_layout(variant, case)
    index = torch.cat([shard_tensor(torch.arange(case.out_features), placement, r, tp) for r in range(tp)])

    def collapse(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.to(torch.float64)
        return torch.zeros(*grad.shape[:-1], case.out_features, dtype=torch.float64).index_add_(-1, index, grad)

    dense = reference(case, Masters(masters.weight, masters.bias, expanded.inputs, [collapse(grad) for grad in expanded.grads]))
    mags = reference(case, Masters(masters.weight, masters.bias, expanded.inputs,
                                   [collapse(grad.abs()) for grad in expanded.grads]))
    out = {f"final_{k}": replica_expanded(v, placement, tp) for k, v in dense.final.items()}
    mag = {f"final_{k}": replica_expanded(mags.mag[f"final_{k}"], placement, tp) for k in dense.final}
    for name, t in (("dweight", dense.dweight), ("dbias", dense.dbias), ("acc_dweight", dense.acc_dweight),
                    ("acc_dbias", dense.acc_dbias)):
        if t is not None:
            out[name], mag[name] = replica_expanded(t, placement, tp), replica_expanded(mags.mag[name], placement, tp)
    return out, mag


def is_divisible(variant: Variant, case: Case) -> bool:
    """Whether every dim the variant shards divides by the tp size: the sharded feature dims, each
    packed part of a packed weight, and the sequence length of a sequence-sharded input/output."""
    return not non_divisible_sizes(variant, case)


def non_divisible_sizes(variant: Variant, case: Case) -> dict[str, int]:
    """The sharded sizes of ``case`` that do not divide by the tp size, by name (empty: divisible)."""
    tp = case.tp_size or case.world_size
    sizes = {"in_features": case.in_features, "out_features": case.out_features}
    bad = {name: sizes[name] for name in variant.sharded_features() if sizes[name] % tp}
    if variant.packed:
        try:
            parts = part_sizes(case.out_features, Shard(0, parts=variant.packed))
        except InvalidArgument:
            parts = ()
        if variant.head_size is not None and parts:
            try:
                replicated_parts(case.out_features, Shard(0, parts=variant.packed, head_size=variant.head_size), tp)
            except InvalidArgument:
                d = variant.head_size
                bad.update({f"packed part {i} ({p // d} heads of head_size={d})": p // d
                            for i, p in enumerate(parts) if p % d or (p // d) % tp and (i == 0 or tp % (p // d))})
        else:
            bad.update({f"packed part {i}": p for i, p in enumerate(parts) if p % tp})
    d = variant.sequence_dim_of(len(case.batch_shape) + 1)
    if d is not None and case.batch_shape[d] % tp:
        bad[f"the sequence length (dim {d})"] = case.batch_shape[d]
    return bad


# --- the rank side -------------------------------------------------------------------------------


def _rank_input(variant: Variant, x: torch.Tensor, rank: int, ws: int, even: bool = True,
                layout: str = "contiguous", grad: bool = True) -> torch.Tensor:
    if variant.input == "sharded":
        x = shard_tensor(x, Shard(-1), rank, ws) if even else torch.tensor_split(x, ws, dim=-1)[rank]
    elif variant.input == "sequence-sharded":
        d = variant.sequence_dim_of(x.dim())
        if d is not None:  # else (a vector) every rank gets it whole, and the layer must refuse it
            x = shard_tensor(x, Shard(d), rank, ws) if even else torch.tensor_split(x, ws, dim=d)[rank]
    # A fresh leaf in the case's memory layout (laid out after sharding: what this rank is handed).
    return apply_layout(x, layout).requires_grad_(grad)


def _replicated_init(variant: Variant, case: Case, into: dict[str, Any]) -> Any:
    """An ``on_built`` hook recording the layer's own values of its replicated parameters."""

    def record(module: Any) -> None:
        for spec in variant.params or ():
            if isinstance(spec.placement, Replicate) and (spec.master == "weight" or case.bias):
                p = get_param(module, spec.name)
                if p is not None:
                    into[spec.name] = p.detach().clone()

    return record


def _master_layout(t: torch.Tensor | None, transposed: bool) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.detach()
    return (t.t() if transposed and t.dim() == 2 else t).clone()


def _partial_params(variant: Variant, module: Any, specs: list[Any]) -> tuple[str, ...]:
    """Master names of the replicated parameters whose grad the trainer sums: declared
    ``grad="partial"``, or marked ``sequence_parallel`` on the built module (Megatron's marker)."""
    out = []
    for spec in specs:
        if not isinstance(spec.placement, Replicate):
            continue  # a sharded grad is complete on its rank; Megatron marks replicated ones only
        param: Any = module
        for part in spec.name.split("."):
            param = getattr(param, part, None)
        if spec.grad == "partial" or getattr(param, "sequence_parallel", False) is True:
            out.append(spec.master)
    return tuple(out)


def rank_main(payload: dict[str, Any]) -> RankResult:
    """What every rank runs for one case (see the module docstring)."""
    this_rank = enter_rank(payload)
    case, variant = this_rank.case, this_rank.variant
    # rank/ws below are the tp rank and tp size: the layer sees its own tp group only.
    group, rank, ws = this_rank.group, this_rank.rank, this_rank.tp
    m: Masters = this_rank.data.for_group(this_rank.group_index)
    layout = payload.get("layout") or case.input_layout
    kwargs = dict(group=group, rank=rank, world_size=ws, master_weight=m.weight, master_bias=m.bias, dtype=case.torch_dtype)

    if not payload["divisible"]:
        # The layer must refuse the case on every rank (before or in its forward), or compute it right
        # with uneven pieces. Refusing is raising, on every rank: exceptions propagate so that a rank that
        # refuses while another goes on into a collective shows up as exactly that.
        return _uneven_rank(this_rank, variant, case, m, kwargs, layout, payload.get("pieces"))

    init: dict[str, Any] = {}
    with rank_phase("build", passthrough=(LayoutError,)):  # a LayoutError: the parent diagnoses the shape
        module = variant.instantiate(case.in_features, case.out_features, case.bias, **kwargs,
                                     on_built=_replicated_init(variant, case, init))
    # What the layer loaded itself (load=False: its builder sliced the masters), as it holds it right
    # after construction: judged against the masters (tpsim.props.linear.checks).
    loaded = {}
    for spec in variant.params or ():
        p = get_param(module, spec.name) if not spec.load and (spec.master == "weight" or case.bias) else None
        if p is not None:
            loaded[spec.master] = _master_layout(p, spec.transposed)
    result = _train(this_rank, variant, case, m, module, init, layout)
    result.loaded = loaded
    return result


def _uneven_rank(this_rank: Any, variant: Variant, case: Case, m: Masters, kwargs: dict[str, Any], layout: str,
                 style: str | None = None) -> RankResult:
    """A case whose sharded sizes do not divide: the layer may refuse it (raise on every rank, while it
    is built or in its first forward), or shard it unevenly and compute it right. The layer is built,
    loaded where its parameters have ``torch.tensor_split``'s or ``torch.chunk``'s pieces
    (:func:`tpsim.placement.uneven_pieces`; a truncated or padded one keeps its own values) and run like
    a divisible case, its input cut the same way, the result marked ``uneven`` when every parameter had
    such a piece. ``style`` (None: tensor_split's where they fit, else chunk's) is the parent's choice on
    a second run, when every rank's shapes fit chunk's pieces and not all fit tensor_split's (a rank
    whose piece has the same size in both layouts cannot tell them apart alone). Every rank runs the
    same steps whatever its shapes, so the ranks' collectives stay in step."""
    rank, ws = this_rank.rank, this_rank.tp
    init: dict[str, Any] = {}
    with rank_phase("build"):
        module = variant.build(case.in_features, case.out_features, case.bias, **kwargs,
                               **variant.layout_kwargs(case.out_features))
    _replicated_init(variant, case, init)(module)
    if variant.packed:
        # tensor_split pieces of packed parts are no layout a library uses: the layer must refuse.
        x = _rank_input(variant, m.inputs[0], rank, ws, even=False, layout=layout, grad=not variant.forward_only)
        with rank_phase("forward", 0), torch.no_grad() if variant.forward_only else contextlib.nullcontext():
            out = variant.call(module, x)
        return RankResult(ACCEPTED, output_shape=tuple(out.shape) if isinstance(out, torch.Tensor) else None,
                          output_type=type(out).__name__, tp_rank=rank)
    masters = {"weight": kwargs["master_weight"], "bias": kwargs["master_bias"]}
    fits = tuple(s for s in UNEVEN_STYLES if _holds_pieces(module, variant, rank, ws, masters, s))
    used = (style if style in fits else None) if style is not None else next(iter(fits), None)
    with uneven_pieces(used or "tensor_split"):
        if used is not None:
            load_master(module, variant, rank=rank, world_size=ws, masters=masters)
        result = _train(this_rank, variant, case, m, module, init, layout)
    result.uneven = used is not None
    result.pieces, result.fits = used, fits
    if result.output is not None:
        result.output_shape = tuple(result.output.shape)
    return result


def _holds_pieces(module: Any, variant: Variant, rank: int, ws: int, masters: dict[str, Any], style: str) -> bool:
    """Whether every parameter of ``module`` has the shape of its ``style`` piece (``uneven_pieces``)."""
    with uneven_pieces(style):
        for spec in variant.params or ():
            master = masters.get(spec.master)
            if master is None:
                continue
            param = get_param(module, spec.name)
            if param is None and spec.absent_ok(rank):
                continue
            try:
                if param is None or tuple(param.shape) != stored_shape(spec, tuple(master.shape), ws, rank):
                    return False
            except InvalidArgument:  # packed parts that do not divide: no piece of either layout
                return False
    return True


def _train(this_rank: Any, variant: Variant, case: Case, m: Masters, module: Any, init: dict[str, Any],
           layout: str) -> RankResult:
    """The training steps of one rank on a built, loaded layer (see the module docstring)."""
    group, rank, ws = this_rank.group, this_rank.rank, this_rank.tp
    specs = [s for s in variant.params or () if s.master == "weight" or case.bias]
    absent = tuple(s.master for s in specs if s.absent_ok(rank) and get_param(module, s.name) is None)
    specs = [s for s in specs if s.master not in absent]
    result = RankResult(OK, init=init, group=this_rank.group_index, tp_rank=rank, partial=_partial_params(variant, module, specs),
                        absent=absent)
    by_master = {spec.master: spec for spec in specs}
    kv_replicas = expanded_out_features(variant, case) is not None
    if variant.forward_only:
        return _forward_only(variant, case, m, module, result, rank, ws, layout)
    optimizer = optimizer_of(module)
    set_to_none = zero_grad_of(case)
    micro = 0
    for step, count in enumerate(schedule(case)):
        for _ in range(count):
            x = _rank_input(variant, m.inputs[micro], rank, ws, layout=layout)
            # A returned bias (skip_bias_add) joins a partial output once: the caller adds it after its all-reduce.
            returned_bias(reset=True, add=variant.output != "partial" or rank == 0)
            try:
                with rank_phase("forward", micro):
                    out = result.read(variant.call(module, x))
            finally:  # read, and add again by default
                result.returned_bias = returned_bias(reset=True) or result.returned_bias
            upstream = m.grads[micro]
            if kv_replicas:  # replicated K/V heads: this rank's own columns
                upstream = shard_tensor(upstream, Shard(-1), rank, ws)
            elif isinstance(variant.output_placement, Shard):  # sharded (packed: per part) or sequence-sharded
                upstream = shard_tensor(upstream, variant.output_placement, rank, ws)
            upstream = apply_layout(upstream, layout)
            if result.unusable(out, upstream.shape, graph=x):
                return result  # a wrong shape or dtype, or a collective outside autograd that cut the graph
            # Plain backward per micro-batch, nothing cleared in between: grads accumulate and every grad
            # hook fires as in training.
            with rank_phase("backward", micro):
                out.backward(upstream.to(out.dtype))
            if micro == 0:
                result.output = out.detach().clone()
                result.input_grad = None if x.grad is None else x.grad.detach().clone()
                for spec in specs:  # cloned (_master_layout): the next micro-batch accumulates into it
                    p = get_param(module, spec.name)
                    result.grads[spec.master] = _master_layout(None if p is None else p.grad, spec.transposed)
            micro += 1
        if step == 0:
            for spec in specs:  # cloned: the trainer's sum and zero_grad change grads in place
                p = get_param(module, spec.name)
                result.accumulated[spec.master] = _master_layout(None if p is None else p.grad, spec.transposed)
        if kv_replicas:
            sum_kv_replicas(variant, case, module, specs, group, rank)
        partial = {master: get_param(module, by_master[master].name) for master in result.partial}
        summed: dict[str, torch.Tensor] = {}
        trainer_step(optimizer, partial, group, step, summed, set_to_none=set_to_none)
        result.summed_grads.update({k: _master_layout(v, False) for k, v in summed.items()})
    for spec in specs:
        result.final[spec.master] = _master_layout(get_param(module, spec.name), spec.transposed)
    return result


def _forward_only(variant: Variant, case: Case, m: Masters, module: Any, result: RankResult, rank: int, ws: int,
                  layout: str) -> RankResult:
    """An inference layer's one forward, under ``torch.no_grad()`` (no grads, no training steps)."""
    x = _rank_input(variant, m.inputs[0], rank, ws, layout=layout, grad=False)
    returned_bias(reset=True, add=variant.output != "partial" or rank == 0)
    try:
        with rank_phase("forward", 0), torch.no_grad():
            out = result.read(variant.call(module, x))
    finally:
        result.returned_bias = returned_bias(reset=True)
    expected = m.grads[0]
    if expanded_out_features(variant, case) is not None:
        expected = shard_tensor(expected, Shard(-1), rank, ws)
    elif isinstance(variant.output_placement, Shard):
        expected = shard_tensor(expected, variant.output_placement, rank, ws)
    if result.unusable(out, expected.shape):
        return result
    result.output = out.detach().clone()
    return result


# --- the parent side -----------------------------------------------------------------------------


@dataclass
class Reference:
    """The float64 dense reference of a case: the first micro-batch's output and grads, the grads
    accumulated over the first optimizer step's micro-batches (``acc_dweight``, ``acc_dbias``), the
    final parameters, and the per-element magnitudes tolerances scale with (see
    :mod:`tpsim.props.tolerance`; ``mag["acc_dweight"]``, ...)."""

    x: torch.Tensor
    y: torch.Tensor
    dx: torch.Tensor
    dweight: torch.Tensor
    dbias: torch.Tensor | None
    weight: torch.Tensor
    bias: torch.Tensor | None
    final: dict[str, torch.Tensor] = field(default_factory=dict)
    mag: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: int = 1
    #: The first micro-batch's upstream grad ``[*batch, out]`` (float64).
    upstream: torch.Tensor | None = None
    acc_dweight: torch.Tensor | None = None
    acc_dbias: torch.Tensor | None = None
    #: Micro-batches of the first optimizer step (the accumulated grads' reduction spans their rows).
    micro_batches: int = 1
    #: The grads of the first optimizer step's micro-batches but the last, each its own (``dweight``,
    #: ``dbias``: lists; the first is ``dweight``/``dbias``), and the magnitude of each.
    earlier: dict[str, list[torch.Tensor | None]] = field(default_factory=dict)


def reference(case: Case, masters: Masters) -> Reference:
    """Dense ``y = x Wᵀ + b`` forward and backward per micro-batch, the grads accumulated over each
    optimizer step's micro-batches (:func:`~tpsim.props.rank.schedule`), and SGD, in float64 from the
    rounded master values."""
    f64 = torch.float64
    w = masters.weight.to(f64)
    b = masters.bias.to(f64) if masters.bias is not None else None
    w0, b0 = w.clone(), None if b is None else b.clone()
    rows = 1
    for s in case.batch_shape:
        rows *= s
    out: dict[str, Any] = {}
    # Each update w - LR * g rounds once relative to |w|; every micro-batch's grad joins through LR * |g|.
    train_mag_w = w.abs() * OPTIMIZER_STEPS
    train_mag_b = None if b is None else b.abs() * OPTIMIZER_STEPS
    micro = 0
    plan = schedule(case)
    earlier: dict[str, list[torch.Tensor | None]] = {}
    for step, count in enumerate(plan):
        acc_w = acc_b = acc_w_mag = acc_b_mag = None
        for _ in range(count):
            x = masters.inputs[micro].to(f64)
            g = masters.grads[micro].to(f64)
            x2 = x.reshape(-1, case.in_features)
            g2 = g.reshape(-1, case.out_features)
            y = x @ w.t() + (b if b is not None else 0.0)
            dx = g @ w
            dw = g2.t() @ x2
            db = g2.sum(0) if b is not None else None
            dw_mag = g2.abs().t() @ x2.abs()
            db_mag = g2.abs().sum(0) if b is not None else None
            train_mag_w = train_mag_w + LR * dw_mag
            if b is not None:
                train_mag_b = train_mag_b + LR * db_mag
            if step == 0 and micro < count - 1:
                for key, t in (("dweight", dw), ("dbias", db), ("mag_dweight", dw_mag), ("mag_dbias", db_mag)):
                    earlier.setdefault(key, []).append(t)
            acc_w = dw if acc_w is None else acc_w + dw
            acc_w_mag = dw_mag if acc_w_mag is None else acc_w_mag + dw_mag
            if b is not None:
                acc_b = db if acc_b is None else acc_b + db
                acc_b_mag = db_mag if acc_b_mag is None else acc_b_mag + db_mag
            if micro == 0:
                out = dict(
                    x=x,
                    upstream=g,
                    y=y,
                    dx=dx,
                    dweight=dw,
                    dbias=db,
                    mag={
                        "y": x.abs() @ w.abs().t() + (b.abs() if b is not None else 0.0),
                        "dx": g.abs() @ w.abs(),
                        "dweight": dw_mag,
                        "dbias": db_mag,
                    },
                )
            micro += 1
        if step == 0:
            out.update(acc_dweight=acc_w, acc_dbias=acc_b)
            out["mag"].update(acc_dweight=acc_w_mag, acc_dbias=acc_b_mag)
        w = w - LR * acc_w
        if b is not None:
            b = b - LR * acc_b
    final = {"weight": w}
    mag = out.pop("mag")
    mag["final_weight"] = train_mag_w
    if b is not None:
        final["bias"] = b
        mag["final_bias"] = train_mag_b
    return Reference(weight=w0, bias=b0, final=final, mag=mag, rows=rows, micro_batches=plan[0], earlier=earlier,
                     **out)
