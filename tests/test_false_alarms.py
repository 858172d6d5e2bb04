"""False-alarm regression suite: correct layers must pass. A false alarm on correct code is the worst
bug this product can have.

Low precision at tiny and subnormal-prone sizes: tpsim's own layers (every variant of
``tpsim check tpsim.layers``) in float16 and bfloat16, with one or two features per rank, one to
three rows, tp groups of 1 to 4 ranks inside worlds of up to 4. With so few terms per element the
results are often tiny, and float16's subnormal range (below 6.1e-5) is where a tolerance that
only scales with the magnitude of the terms has no room left for the rounding of the result
itself. The cases are drawn from a fixed seed (a plain ``random.Random``, not Hypothesis: every
failing case is collected and counted rather than shrunk to one), so a run is repeatable and its
count of false alarms comparable before and after a change.

The fast version runs a few dozen cases per variant; the ``slow`` one 500 per variant.
"""

from __future__ import annotations

import random

import pytest
import torch

from tpsim import builtin_variants
from tpsim.placement import Shard, part_sizes
from tpsim.props import check_case
from tpsim.props.linear.case import Case
from tpsim.props.linear.world import make_masters
from tpsim.variant import Variant

LOW_PRECISION = ("float16", "bfloat16")
WORLD_SIZES = (1, 2, 3, 4)
OWN_LAYERS = builtin_variants.TPSIM_VARIANTS


def tiny_case(variant: Variant, rng: random.Random, dtypes: tuple[str, ...] = LOW_PRECISION) -> Case:
    """A divisible case of ``variant`` with one or two features per rank and at most three rows."""
    ws = rng.choice(WORLD_SIZES)
    divisors = [t for t in range(1, ws + 1) if ws % t == 0]
    tp = ws if rng.random() < 0.5 or not variant.subgroups else rng.choice(divisors)
    sizes = {"in_features": rng.randint(1, 3), "out_features": rng.randint(1, 3)}
    for name in variant.sharded_features():
        sizes[name] = tp * rng.randint(1, 2)
    if variant.packed:
        sizes["out_features"] = sum(variant.packed) * tp * rng.randint(1, 2)
        part_sizes(sizes["out_features"], Shard(0, parts=variant.packed))  # divisible by construction
    ndims = rng.randint(max(variant.min_batch_dims, variant.min_sequence_batch_dims()), 2)
    batch = [rng.randint(1, 3) for _ in range(ndims)]
    seq = variant.sequence_dim_of(ndims + 1)
    if seq is not None:
        batch[seq] = tp * rng.randint(1, 2)
    return Case(
        world_size=ws,
        tp_size=tp,
        in_features=max(sizes["in_features"], variant.min_features),
        out_features=max(sizes["out_features"], variant.min_features),
        batch_shape=tuple(batch),
        dtype=rng.choice(dtypes),
        bias=variant.bias and rng.random() < 0.5,
        seed=rng.randrange(2**31),
    )


#: Smallest normal float16 number: below it float16 is subnormal and its spacing stops shrinking.
FP16_TINY = torch.finfo(torch.float16).tiny


def smallest_magnitude(case: Case) -> float:
    """The smallest magnitude ``sum_k |a_k b_k|`` of any element of the case's dense results (outputs,
    input grads, weight grads, every step and tp group): where it is below float16's smallest
    normal, a bound proportional to it is smaller than float16's subnormal spacing."""
    m = make_masters(case)
    w = m.weight.double().abs()
    smallest = float("inf")
    for inputs, grads in [(m.inputs, m.grads), *m.groups]:
        for x, g in zip(inputs, grads, strict=True):
            x2 = x.double().abs().reshape(-1, case.in_features)
            g2 = g.double().abs().reshape(-1, case.out_features)
            for mag in (x2 @ w.t(), g2 @ w, g2.t() @ x2):
                smallest = min(smallest, float(mag.min()))
    return smallest


def subnormal_prone_case(variant: Variant, rng: random.Random, tries: int = 4000) -> Case:
    """A tiny float16 case whose seed puts some element of its dense results in float16's subnormal
    range (the seed is redrawn until one does; random products of a few normal draws fall there
    about once in a few hundred seeds)."""
    case = tiny_case(variant, rng, dtypes=("float16",))
    for _ in range(tries):
        if smallest_magnitude(case) < FP16_TINY:
            return case
        case = case.replace(seed=rng.randrange(2**31))
    return case


def false_alarms(variant: Variant, examples: int, seed: int) -> list[str]:
    """Every failure of ``examples`` tiny low-precision cases of ``variant``, half of them subnormal-prone
    (all failures, not the first)."""
    rng = random.Random(f"{variant.name}/{seed}")
    found = []
    for i in range(examples):
        case = subnormal_prone_case(variant, rng) if i % 2 else tiny_case(variant, rng)
        found.extend(f.describe() for f in check_case(variant, case))
    return found


@pytest.mark.thorough  # minutes over all layers; the fast tier searches every correct variant (test_mutants)
@pytest.mark.parametrize("variant", OWN_LAYERS, ids=lambda v: v.name)
def test_low_precision_tiny_cases_pass(variant: Variant) -> None:
    found = false_alarms(variant, examples=30, seed=0)
    assert not found, f"{len(found)} false alarm(s):\n" + "\n".join(found[:3])


@pytest.mark.slow
@pytest.mark.parametrize("variant", OWN_LAYERS, ids=lambda v: v.name)
def test_low_precision_tiny_cases_pass_250_more_examples(variant: Variant) -> None:
    # 250: the thorough tier's share of its 60 minutes on 2 cores (500 took 15 of them); the seed differs
    # from the fast tier's, so these are other cases.
    found = false_alarms(variant, examples=250, seed=1)
    assert not found, f"{len(found)} false alarm(s):\n" + "\n".join(found[:3])


def test_the_reported_float16_subnormal_case_passes() -> None:
    # The input grad's element is subnormal in float16 (-7.75e-7 vs -7.83e-7, correctly rounded):
    # a bound proportional to the terms' magnitude alone has no room for the result's own rounding.
    case = Case(world_size=2, tp_size=1, in_features=1, out_features=1, batch_shape=(3,), dtype="float16",
                bias=False, seed=4092719)
    assert check_case(builtin_variants.column, case) == []


# --- layers in the styles people write ------------------------------------------------------------
#
# Correct layers nobody here designed, written fresh in tests/wild/ in the styles of real code:
# a tp group in a module global set by an init function that synchronises the ranks (fairscale's
# style), a bias the constructor cannot turn off, sequence parallelism whose bias grad the trainer
# sums (Megatron's marker ``bias.sequence_parallel = True``), and Megatron-style constructors that
# take the group by keyword and return ``(output, bias)`` under ``skip_bias_add``. Each must pass
# on inproc and gloo.
#
# Before the fixes this suite guards (conventions that read the built module, the ``group``
# convention, rank-local module state, trainer-reduced grads), 100 examples per target (seed 0) on
# inproc reported these false alarms, distinct (property, diagnosis) per target:
#   module-global groups:       column 1 (exception), row 1 (exception, after ~40 s of timeouts)
#   always-on bias:             column 1 (mismatch), row 2 (mismatch, precision-loss)
#   sequence parallel, trainer: column 0, row 2 (grad-not-reduced, replica-divergence)
#   group keyword, tuple output: all 3 classes refused as fitting no convention (exit 2)
# i.e. 7 false alarms in 6 targets and 3 refusals; on gloo (30 examples) the same except the
# module-global layers, which gloo ran (one process per rank) but reported divisibility-unchecked
# once each. After them: 0.

import pathlib  # noqa: E402 - this section's own imports

from tpsim.errors import SharedModuleState  # noqa: E402
from tpsim.props.search import search  # noqa: E402
from tpsim.target import resolve_target  # noqa: E402

WILD = pathlib.Path(__file__).resolve().parent / "wild"
#: (id, target, options): the styles above; options as the CLI flags would give them.
STYLES = [
    ("module-global.column", f"{WILD}/fairscale_style.py:column", {}),
    ("module-global.row", f"{WILD}/fairscale_style.py:row", {}),
    ("always-bias.column", f"{WILD}/always_bias.py:ColumnParallelLinear", {}),
    ("always-bias.row", f"{WILD}/always_bias.py:RowParallelLinear", {}),
    ("sequence-parallel.column", f"{WILD}/megatron_style.py:sp_column", {}),
    ("sequence-parallel.row", f"{WILD}/megatron_style.py:sp_row", {}),
    ("sequence-parallel.group-row", f"{WILD}/megatron_style.py:RowParallelLinear", {"output": "sequence-sharded"}),
    ("sequence-parallel.group-column", f"{WILD}/megatron_style.py:ColumnParallelLinear",
     {"input": "sequence-sharded"}),
    ("group.column", f"{WILD}/megatron_style.py:ColumnParallelLinear", {}),
    ("group.column-gathered", f"{WILD}/megatron_style.py:ColumnParallelLinear", {"output": "gathered"}),
    ("group.row", f"{WILD}/megatron_style.py:RowParallelLinear", {}),
    ("group.row-replicated-input", f"{WILD}/megatron_style.py:RowParallelLinear", {"input": "replicated"}),
    ("group.projection-skip-bias-add", f"{WILD}/megatron_style.py:ProjectionRowLinear", {}),
]
STYLE_IDS = [s[0] for s in STYLES]


def style_false_alarms(target: str, options: dict, **settings) -> list[str]:
    (variant,) = resolve_target(target, **options)
    report = search(variant, **settings)
    found = [f"{f.property}: {f.diagnosis}: {f.message} [{f.case.describe() if f.case else ''}]"
             for f in report.failures]
    # A pass must have run the whole budget (a search cut short proves little).
    assert found or report.examples >= settings["max_examples"], (report.examples, report.notes)
    return found


@pytest.mark.parametrize("name, target, options", STYLES, ids=STYLE_IDS)
def test_wild_style_passes(name: str, target: str, options: dict) -> None:
    found = style_false_alarms(target, options, max_examples=25, seed=0, world_sizes=(1, 2, 3, 4))
    assert not found, f"{len(found)} false alarm(s) on correct code:\n" + "\n".join(found)


@pytest.mark.slow
@pytest.mark.parametrize("name, target, options", STYLES, ids=STYLE_IDS)
def test_wild_style_passes_500_examples(name: str, target: str, options: dict) -> None:
    found = style_false_alarms(target, options, max_examples=500, seed=1, world_sizes=(1, 2, 3, 4))
    assert not found, f"{len(found)} false alarm(s) on correct code:\n" + "\n".join(found)


@pytest.mark.gloo
@pytest.mark.parametrize("name, target, options", STYLES, ids=STYLE_IDS)
def test_wild_style_passes_on_gloo(name: str, target: str, options: dict) -> None:
    found = style_false_alarms(target, options, max_examples=4, seed=0, world_sizes=(2,),
                               dtypes=("float64", "float32"), backend="gloo")
    assert not found, f"{len(found)} false alarm(s) on correct code:\n" + "\n".join(found)


def test_module_global_groups_need_rank_local_state_on_inproc() -> None:
    # Without the mechanism the thread-ranks rebind one module global: reported on its own, with
    # the fix, never as the layer's failure (nor after a timeout).
    (variant,) = resolve_target(f"{WILD}/fairscale_style.py:column")
    assert variant.rank_local  # automatic: the module the variant comes from
    with pytest.raises(SharedModuleState, match=r"_MODEL_PARALLEL_GROUP.*--rank-local"):
        search(variant.replace(rank_local=()), max_examples=10, seed=0, world_sizes=(2,))
