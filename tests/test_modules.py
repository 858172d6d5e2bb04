"""Whole modules as targets: the dense reference is the module on one rank, the sharding is read from
shapes (or declared), the properties hold for tpsim's MLPs, and bugs are named with their sublayer."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from torch import nn

from tpsim.builtin_variants import mlp_variant
from tpsim.cli import main
from tpsim.errors import InvalidArgument
from tpsim.layers.mlp import DenseMLP
from tpsim.module_variant import ModuleVariant, module_from_class
from tpsim.placement import Replicate, Shard
from tpsim.props.module.case import ModuleCase
from tpsim.props.module.family import MODULE
from tpsim.props.module.magnitude import ACTIVATIONS
from tpsim.props.module.sharding import infer_layout, uneven_size
from tpsim.props.search import search
from tpsim.target import resolve_target
from tpsim.variant import ParamSpec

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGETS = "tests/module_targets.py"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def _target(name: str) -> ModuleVariant:
    (variant,) = resolve_target(f"{TARGETS}:{name}", kind="module")
    return variant


def _labels(failures) -> list[tuple[str, str]]:
    return [(f.property, f.label) for f in failures]


# --- describing a module ------------------------------------------------------------------------


def test_a_plain_class_gives_its_sizes_and_group_keyword() -> None:
    v = _target("GoodMLP")
    assert v.sizes == ("hidden", "ffn") and v.input == "replicated" and v.output == "replicated"
    assert "process_group=group" in v.description


@pytest.mark.parametrize(
    "source, message",
    [
        ("def __init__(self, hidden: int, ffn: int): ...",
         r"takes no tp group: a whole-module target needs a constructor keyword process_group / group / tp_group"),
        ("def __init__(self, hidden: int, ratio: float, *, group=None): ...",
         r"parameter 'ratio' is annotated .*float.*, not int"),
        ("def __init__(self, hidden: int, *, group=None, width): ...",
         r"the keyword-only parameter 'width' has no default"),
        ("def __init__(self, *, tp_group=None): ...", r"takes no integer sizes"),
    ],
)
def test_a_class_that_does_not_fit_is_refused_with_the_reason(source: str, message: str) -> None:
    namespace: dict = {}
    exec(f"class M(nn.Module):\n    {source}", {"nn": nn}, namespace)
    with pytest.raises(InvalidArgument, match=message):
        module_from_class(namespace["M"])


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"sizes": ()}, r"sizes=\(\); expected the distinct names"),
        ({"output": "sideways"}, r"output='sideways'; expected one of replicated, partial, sharded, sequence-sharded"),
        ({"min_sizes": (1,)}, r"min_sizes=\(1,\) has 1 entries for 2 sizes"),
        ({"sequence_dim": -1}, r"sequence_dim=-1; expected an int naming a dim before the feature dim"),
        ({"params": (ParamSpec("fc1.weight", "weight", Shard(0), load=False),)}, r"load=False\) is not supported"),
    ],
)
def test_module_variant_fields_are_checked(changes: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        mlp_variant("gelu").replace(**changes)


def test_reduced_and_gathered_outputs_mean_replicated() -> None:
    assert mlp_variant("gelu").replace(output="reduced").output == "replicated"


@pytest.mark.parametrize(
    "full, local, rank, expected",
    [
        ((8, 4), (8, 4), 0, "R"),
        ((8, 4), (4, 4), 1, "S(0)"),
        ((8, 4), (8, 2), 0, "S(1)"),
        ((5, 4), (3, 4), 0, "S(0) (uneven)"),  # torch.tensor_split: ceil on the first ranks
        ((5, 4), (2, 4), 1, "S(0) (uneven)"),
        ((5, 4), (2, 4), 0, None),  # a floor on rank 0: truncated
        ((8, 4), (4, 2), 0, None),  # two dims cut
    ],
)
def test_the_sharded_dim_is_read_from_the_shapes(full, local, rank, expected) -> None:
    layout = infer_layout(full, local, 2, rank)
    assert (layout.describe() if layout else None) == expected
    assert uneven_size(5, 2, 0) == 3 and uneven_size(5, 2, 1) == 2


def test_a_layer_that_describes_its_packed_parts_is_sharded_per_part() -> None:
    owner = nn.Module()
    owner.parts = (4, 4)  # tpsim.layers' sharding description
    assert infer_layout((8, 3), (4, 3), 2, 0, owner).placement == Shard(0, parts=(4, 4))
    assert infer_layout((8, 3), (4, 3), 2, 0, nn.Module()).placement == Shard(0)


# --- tpsim's own MLPs hold every property --------------------------------------------------------


@pytest.mark.parametrize("activation", ["gelu", "silu", "swiglu", "geglu"])
@pytest.mark.parametrize("world_size, tp_size, layout", [(1, 1, "consecutive"), (2, 2, "consecutive"),
                                                         (3, 3, "consecutive"), (4, 2, "strided"), (8, 8, "consecutive")])
def test_parallel_mlp_matches_its_dense_self(activation, world_size, tp_size, layout) -> None:
    v = mlp_variant(activation)
    for dtype, batch in (("float64", (3,)), ("float32", (2, 3))):
        # hidden 5 does not divide: the MLP does not shard it and must just work.
        case = ModuleCase(world_size=world_size, tp_size=tp_size, tp_layout=layout, sizes=(5, 2 * tp_size),
                          batch_shape=batch, dtype=dtype, seed=world_size)
        assert MODULE.check_case(v, case) == [], case.describe()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_sequence_parallel_mlp_matches_its_dense_self(world_size) -> None:
    v = mlp_variant("swiglu", sequence_parallel=True)
    for dtype, batch in (("float64", (2 * world_size,)), ("float32", (2, 3 * world_size))):
        case = ModuleCase(world_size=world_size, sizes=(6, 2 * world_size), batch_shape=batch, dtype=dtype, seed=3)
        assert MODULE.check_case(v, case) == []


def test_a_size_that_the_mlp_shards_and_cannot_divide_is_refused_clearly() -> None:
    # ffn=5 over 2 ranks: ParallelMLP raises a ValueError naming it on every rank (the property holds).
    case = ModuleCase(world_size=2, sizes=(4, 5), batch_shape=(2,), seed=0)
    assert MODULE.check_case(mlp_variant("swiglu"), case) == []


def test_the_dense_reference_can_be_given() -> None:
    def dense(hidden, ffn, *, dtype):
        return DenseMLP(hidden, ffn, activation="swiglu", dtype=dtype)

    v = mlp_variant("swiglu").replace(dense=dense)
    assert MODULE.check_case(v, ModuleCase(world_size=2, sizes=(4, 6), batch_shape=(3,), dtype="float32", seed=1)) == []


def test_the_search_checks_the_mlps_in_every_dtype() -> None:
    # bfloat16 and float16 are judged against the dense twin at that precision (no dtype is left out).
    report = search(mlp_variant("gelu"), max_examples=15, seed=0, world_sizes=(1, 2, 3))
    assert report.passed and report.examples == 15
    assert not any("only" in n and "dtypes" in n for n in report.notes)
    low = search(mlp_variant("gelu"), max_examples=12, seed=0, world_sizes=(1, 2, 3), dtypes=("bfloat16", "float16"))
    assert low.passed and low.examples == 12, [f.describe() for f in low.failures]


# --- bugs are named where they are ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        ("GoodMLP", []),
        ("BiasDuplicatedMLP", [("forward-equivalence", "fc2: bias-duplication")]),
        ("InputGradNotReducedMLP", [("input-grad-equivalence", "fc1: grad-not-reduced")]),
        ("InputGradAveragedMLP", [("input-grad-equivalence", "fc1: grad-scaled")]),
        ("UnreducedMLP", [("forward-equivalence", "fc2: missing-reduction")]),
        ("BiasOnRank0MLP", [("bias-grad-equivalence", "fc2: bias-grad-rank0-only")]),
        ("BiasDividedMLP", [("bias-grad-equivalence", "fc2: grad-scaled")]),
    ],
)
def test_a_bug_inside_a_sublayer_is_named_with_it(name: str, expected: list) -> None:
    case = ModuleCase(world_size=2, sizes=(4, 6), batch_shape=(3,), seed=3)
    assert _labels(MODULE.check_case(_target(name), case)) == expected


def test_consequences_are_listed_under_their_cause() -> None:
    case = ModuleCase(world_size=2, sizes=(4, 6), batch_shape=(3,), seed=3)
    (cause,) = MODULE.check_case(_target("InputGradNotReducedMLP"), case)
    assert cause.sublayer == "fc1"
    assert [(c.property, c.diagnosis) for c in cause.consequences] == [("replica-consistency", "replica-divergence")]
    assert "the input grad of fc1" in cause.message and "only its own summand" in cause.message


def test_a_divergence_between_sublayers_is_named_by_the_sublayer_after_it() -> None:
    case = ModuleCase(world_size=2, sizes=(4, 6), batch_shape=(3,), seed=3)
    failures = MODULE.check_case(_target("ActivationOnWrongHalfMLP"), case)
    assert failures[0].property == "forward-equivalence" and failures[0].sublayer == "before fc2"


def test_a_packed_layout_the_shapes_cannot_tell_is_declared() -> None:
    case = ModuleCase(world_size=2, sizes=(4, 4), batch_shape=(3,), seed=0)
    inferred = MODULE.check_case(_target("PackedGateUpMLP"), case)
    assert inferred and "declare it: ModuleVariant(params=(ParamSpec('fc1.weight', 'weight', Shard(0, parts=(1, 1)))" \
        in inferred[0].message
    (declared,) = resolve_target(f"{TARGETS}:packed_declared")
    assert MODULE.check_case(declared, case) == []


def test_a_truncated_size_is_divisibility_unchecked_and_an_uneven_one_is_fine() -> None:
    case = ModuleCase(world_size=2, sizes=(4, 5), batch_shape=(3,), seed=0)
    (failure,) = MODULE.check_case(_target("FloorShardedMLP"), case)
    assert (failure.property, failure.label) == ("divisibility", "fc1: divisibility-unchecked")
    assert "ffn=5 is not divisible by world_size=2" in failure.message and "'fc1.weight' has shape [2, 4]" in failure.message
    assert MODULE.check_case(_target("UnevenShardedMLP"), case) == []
    assert MODULE.check_case(_target("UnevenShardedMLP"), case.replace(world_size=3, tp_size=3, sizes=(4, 7))) == []


def test_a_module_without_a_derived_bound_is_judged_by_its_dense_twin() -> None:
    # torch.exp has no magnitude rule: the dense twin sets the tolerance (never a usage error).
    for dtype in ("float64", "float32", "bfloat16"):
        case = ModuleCase(world_size=2, sizes=(2, 2), batch_shape=(3,), dtype=dtype, seed=0)
        assert MODULE.check_case(_target("ExpMLP"), case) == []


def test_grads_through_a_kink_are_compared_in_float64_only() -> None:
    v = mlp_variant("relu")
    for dtype in ("float64", "float32"):
        assert MODULE.check_case(v, ModuleCase(world_size=2, sizes=(6, 8), batch_shape=(4,), dtype=dtype, seed=2)) == []
    # The bug is still caught in a float64 case.
    buggy = _target("InputGradNotReducedMLP")
    assert MODULE.check_case(buggy, ModuleCase(world_size=2, sizes=(4, 6), batch_shape=(3,), seed=3))


def test_activation_envelopes_bound_the_derivatives() -> None:
    import torch.nn.functional as F

    x = torch.linspace(-30, 30, 200001, dtype=torch.float64, requires_grad=True)
    functions = {"gelu": F.gelu, "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "softplus": F.softplus,
                 "mish": F.mish, "elu": F.elu, "celu": F.celu, "selu": F.selu, "logsigmoid": F.logsigmoid}
    for name, fn in functions.items():
        (d1,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
        (d2,) = torch.autograd.grad(d1.sum(), x)
        spec = ACTIVATIONS[name]
        assert float(d1.abs().max()) <= spec.lipschitz, name
        assert float(d2.abs().max()) <= spec.curvature + 1e-9, name
        assert float(fn(torch.zeros(1, dtype=torch.float64)).abs()) <= spec.at_zero + 1e-12, name


class _HandRMSNorm(nn.Module):
    """An RMSNorm written out (as Llama's is): x * rsqrt(mean(x^2) + eps) * weight."""

    def __init__(self, hidden: int, *, group: object = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _ShiftedLayerNorm(nn.LayerNorm):
    """A LayerNorm of rows whose mean is 1000 times their spread: float32 loses most digits to the
    cancellation of the mean, which the bound must cover (M_x / sigma), not flag."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(1000.0 + x)


class _NormOnlyWhenPositive(nn.LayerNorm):
    """Takes the norm only for inputs without a negative entry: the magnitude run (absolute values)
    takes it where the reference did not, so the norm's values were never recorded."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if bool((x >= 0).all()) else x * 2.0


def _norm(cls: type) -> ModuleVariant:
    def build(hidden: int, *, group: object, dtype: torch.dtype) -> nn.Module:
        return cls(hidden, dtype=dtype) if issubclass(cls, (nn.LayerNorm, nn.RMSNorm)) else cls(hidden, group=group,
                                                                                                   dtype=dtype)

    return ModuleVariant(name=cls.__name__, build=build, sizes=("hidden",))


@pytest.mark.parametrize("cls", [nn.LayerNorm, nn.RMSNorm, _HandRMSNorm, _ShiftedLayerNorm], ids=lambda c: c.__name__)
def test_norms_have_a_derived_bound(cls: type) -> None:
    # layer_norm, rms_norm (nn.RMSNorm's eps is its dtype's: float32 adds another than the float64
    # reference) and the rsqrt of a hand-written one, in float64 and float32, at every world size.
    report = search(_norm(cls), max_examples=60, seed=0)
    assert report.passed, [f.describe() for f in report.failures]
    assert report.examples == 60


def test_a_norm_without_the_reference_values_is_judged_by_the_twin() -> None:
    case = ModuleCase(world_size=2, sizes=(4,), batch_shape=(3,), seed=0)
    assert MODULE.check_case(_norm(_NormOnlyWhenPositive), case) == []


# --- the search, case files and replay ------------------------------------------------------------


def test_the_check_shrinks_saves_and_replays_a_sublayer_bug(capsys, tmp_path) -> None:
    target = f"{TARGETS}:BiasDuplicatedMLP"
    code = main(["check", target, "--kind", "module", "--seed", "0", "--max-examples", "30", "--world-sizes", "1,2,3,4",
                 "--cases-dir", str(tmp_path), "--report", "json", "--no-isolate"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1
    (failure,) = doc["failures"]
    assert (failure["property"], failure["sublayer"], failure["diagnosis"]) == ("forward-equivalence", "fc2",
                                                                                "bias-duplication")
    # Shrunk: the smallest world that shows it, the smallest sizes, no batch.
    assert failure["case"]["world_size"] == 2 and failure["case"]["sizes"] == [2, 2]
    assert doc["variants"][0]["family"] == "module" and doc["variants"][0]["kind"] == "module"
    saved = json.loads(pathlib.Path(failure["case_file"]).read_text())
    assert saved["family"] == "module" and saved["found"]["sublayer"] == "fc2"
    code = main(["replay", failure["case_file"], "--no-isolate"])
    out = capsys.readouterr().out
    assert code == 1
    assert "recorded: forward-equivalence: fc2: bias-duplication on inproc" in out
    assert "FAILED forward-equivalence: fc2: bias-duplication" in out and "FAIL reproduced" in out


@pytest.mark.gloo
def test_a_module_case_found_on_inproc_replays_on_gloo(capsys, tmp_path) -> None:
    case = ModuleCase(world_size=2, sizes=(2, 2), size_names=("hidden", "ffn"), seed=0,
                      target=f"{TARGETS}:InputGradNotReducedMLP", variant="InputGradNotReducedMLP", options=(("kind", "module"),),
                      property="input-grad-equivalence")
    from tpsim.props.case import save_case

    path = save_case(case, str(tmp_path), found={"property": "input-grad-equivalence",
                                                 "diagnosis": "grad-not-reduced", "sublayer": "fc1", "backend": "inproc"})
    code = main(["replay", path, "--backend", "gloo"])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert "FAILED input-grad-equivalence: fc1: grad-not-reduced" in out and "reproduced" in out


def test_property_tests_run_a_module_target(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from tpsim.props import PropertyFailed
    from tpsim.props.suite import property_tests

    monkeypatch.chdir(tmp_path)
    target = str(ROOT / TARGETS) + ":BiasDividedMLP"
    cls = property_tests(target, target_options={"kind": "module"}, max_examples=20, seed=0, world_sizes=(1, 2))
    (variant,) = resolve_target(target, kind="module")
    request = SimpleNamespace(config=SimpleNamespace(getoption=lambda name, default=None: "inproc"),
                              node=SimpleNamespace(nodeid="tests/test_user.py::TestMLP::test_property"))
    instance = cls()
    instance.test_forward_equivalence(variant=variant, request=request)
    with pytest.raises(PropertyFailed, match=r"bias-grad-equivalence failed \(grad-scaled\)") as info:
        instance.test_bias_grad_equivalence(variant=variant, request=request)
    notes = "\n".join(info.value.__notes__)
    assert "bias-grad-equivalence: fc2: grad-scaled" in notes and "Reproduce: tpsim replay .tpsim/cases/" in notes


def test_declared_params_override_the_inference() -> None:
    # Declaring fc2.bias sharded contradicts the module (it is replicated): the check says so.
    v = mlp_variant("gelu").replace(params=(ParamSpec("fc2.bias", "bias", Shard(0)),))
    (failure,) = MODULE.check_case(v, ModuleCase(world_size=2, sizes=(4, 4), batch_shape=(2,), seed=0))
    assert failure.label == "fc2: shape-error" and "its declared placement S(0) implies another shape" in failure.message
    v = mlp_variant("gelu").replace(params=(ParamSpec("fc2.bias", "bias", Replicate()),))
    assert MODULE.check_case(v, ModuleCase(world_size=2, sizes=(4, 4), batch_shape=(2,), seed=0)) == []


def test_a_replicated_grad_left_partial_is_named_and_the_trainers_sum_can_be_declared() -> None:
    case = ModuleCase(world_size=2, sizes=(4, 4), batch_shape=(4,), seed=0)
    (not_reduced,) = resolve_target(f"{TARGETS}:sp_bias_not_reduced")
    failures = MODULE.check_case(not_reduced, case)
    assert _labels(failures) == [("bias-grad-equivalence", "fc2: grad-not-reduced")]
    assert failures[0].details["param"] == "fc2.bias"
    (declared,) = resolve_target(f"{TARGETS}:sp_bias_trainer_reduced")
    assert MODULE.check_case(declared, case) == []


def test_constants_of_mixed_signs_enter_the_magnitude_run_as_magnitudes() -> None:
    v = _target("SignedMLP")
    for dtype in ("float64", "float32"):
        assert MODULE.check_case(v, ModuleCase(world_size=2, sizes=(4, 6), batch_shape=(3,), dtype=dtype, seed=1)) == []
