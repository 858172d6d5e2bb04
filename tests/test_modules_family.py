"""The family protocol: every family implements it, the search, the CLI and case files dispatch by it,
and old (schema 1, linear) case files still load."""

from __future__ import annotations

import json

import pytest

from tpsim.builtin_variants import column, mlp_swiglu
from tpsim.errors import InvalidArgument
from tpsim.module_variant import ModuleVariant
from tpsim.props.case import SCHEMA_VERSION, CaseFileError, load_case, save_case
from tpsim.props.family import Family, families, family_named, family_of, family_of_case
from tpsim.props.linear.case import Case
from tpsim.props.module.case import ModuleCase
from tpsim.target import TargetError, resolve_target
from tpsim.variant import Variant


def test_every_registered_family_implements_the_protocol() -> None:
    found = families()
    assert [f.name for f in found][:2] == ["linear", "module"]
    for family in found:
        assert isinstance(family, Family), family
        assert family_named(family.name) is family
        assert family.properties and family.kinds


def test_variants_and_cases_find_their_family() -> None:
    assert family_of(column).name == "linear"
    assert family_of(mlp_swiglu).name == "module"
    assert family_of_case(Case(world_size=2, in_features=2, out_features=2)).name == "linear"
    assert family_of_case(ModuleCase(world_size=2, sizes=(2, 2))).name == "module"
    with pytest.raises(InvalidArgument, match="family='nope'; expected one of linear, module"):
        family_named("nope")
    with pytest.raises(InvalidArgument, match="is not a variant of any tpsim family"):
        family_of(object())


def test_a_bare_module_gives_its_linear_layers_then_its_modules() -> None:
    found = resolve_target("tpsim.layers")
    kinds = [type(v) for v in found]
    first_module = kinds.index(ModuleVariant)
    assert all(k is Variant for k in kinds[:first_module])
    names = [v.name for v in found if isinstance(v, ModuleVariant)]
    assert names[:3] == ["ParallelMLP(gelu)", "ParallelMLP(swiglu)", "ParallelMLP(swiglu, sequence_parallel=True)"]
    # Named, from either family; every variant remembers how to be resolved again.
    (mlp,) = resolve_target("tpsim.layers:ParallelMLP(swiglu)")
    assert mlp.target == "tpsim.layers:ParallelMLP(swiglu)" and mlp.sizes == ("hidden", "ffn")
    (col,) = resolve_target("tpsim.layers:ColumnParallelLinear")
    assert isinstance(col, Variant)
    with pytest.raises(TargetError, match="declares no variant named 'Nope'; it declares: ColumnParallelLinear"):
        resolve_target("tpsim.layers:Nope")


def test_adapter_options_of_linear_layers_leave_the_modules_of_a_bare_module_out() -> None:
    found = resolve_target("tpsim.layers", input_grad="partial")
    assert found and all(isinstance(v, Variant) for v in found)


def test_kind_module_picks_the_module_family_and_unknown_kinds_are_refused() -> None:
    (v,) = resolve_target("examples/my_mlp.py:TensorParallelMLP", kind="module")
    assert isinstance(v, ModuleVariant) and v.sizes == ("hidden", "ffn")
    assert dict(v.options) == {"kind": "module"}
    with pytest.raises(TargetError, match="kind='blob'; expected one of"):
        resolve_target("examples/my_mlp.py:TensorParallelMLP", kind="blob")


def test_a_module_class_without_kind_module_says_how_to_check_it() -> None:
    with pytest.raises(InvalidArgument, match="check it with --kind module"):
        resolve_target("examples/my_mlp.py:TensorParallelMLP")


def test_linear_only_options_are_refused_for_modules() -> None:
    with pytest.raises(InvalidArgument, match="--packed applies to single linear layers"):
        resolve_target("examples/my_mlp.py:TensorParallelMLP", kind="module", packed=(1, 1))


def test_a_module_case_file_round_trips_with_its_family(tmp_path) -> None:
    case = ModuleCase(world_size=4, tp_size=2, tp_layout="strided", sizes=(6, 8), size_names=("hidden", "ffn"),
                      batch_shape=(2, 3), dtype="float32", seed=7, target="tpsim.layers",
                      variant="ParallelMLP(swiglu)", property="forward-equivalence")
    path = save_case(case, str(tmp_path), found={"property": "forward-equivalence", "sublayer": "fc2"})
    doc = json.loads(open(path).read())
    assert doc["schema_version"] == SCHEMA_VERSION == 2 and doc["family"] == "module"
    loaded, found = load_case(path)
    assert loaded == case and found["sublayer"] == "fc2"
    assert "hidden=6 ffn=8" in loaded.describe()


def test_a_schema_1_linear_case_file_still_loads(tmp_path) -> None:
    case = Case(world_size=2, in_features=4, out_features=2, bias=True, target="tpsim.layers",
                variant="RowParallelLinear")
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": "tpsim-case", "schema_version": 1, "tpsim_version": "0.1.0",
                                "case": case.to_dict(), "found": {"property": "forward-equivalence"}}))
    loaded, _ = load_case(str(path))
    assert loaded == case
    # Schema 1 knew no families: a "family" key there is not read.
    path.write_text(json.dumps({"format": "tpsim-case", "schema_version": 1, "family": "module",
                                "case": case.to_dict()}))
    assert load_case(str(path))[0] == case


def test_a_case_file_of_an_unknown_family_is_refused_clearly(tmp_path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": "tpsim-case", "schema_version": 2, "family": "blob", "case": {}}))
    with pytest.raises(CaseFileError, match="is corrupt: family='blob'; expected one of linear, module"):
        load_case(str(path))
    path.write_text(json.dumps({"format": "tpsim-case", "schema_version": 2, "family": "module",
                                "case": {"world_size": 2, "sizes": [2, 2], "bogus": 1}}))
    with pytest.raises(CaseFileError, match=r"unknown module case field\(s\) \['bogus'\]"):
        load_case(str(path))
