"""Target resolution and the convention adapters behind ``tpsim check TARGET``: convention and
kind detection, and master values loaded into every parameter by its placement."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

import tpsim
from tpsim.conventions import detect_convention, detect_kind, variant_from_class
from tpsim.errors import InvalidArgument
from tpsim.target import TargetError, resolve_target, resolve_variant
from tpsim.variant import Variant

ROOT = pathlib.Path(__file__).resolve().parent.parent
SKILL = str(ROOT / "examples" / "skill_convention.py")
TUTORIAL = str(ROOT / "examples" / "tutorial_convention.py")


def _classes(path: str) -> dict[str, type]:
    # The example module as the target resolver imported it.
    resolve_target(path)
    module = next(m for name, m in sys.modules.items() if name.startswith("tpsim_target_") and
                  getattr(m, "__file__", None) == path)
    return {n: getattr(module, n) for n in ("ColumnParallelLinear", "RowParallelLinear")}


def test_conventions_are_detected_from_the_constructor() -> None:
    skill, tutorial = _classes(SKILL), _classes(TUTORIAL)
    assert detect_convention(skill["RowParallelLinear"]) == "master-weight"
    assert detect_convention(tutorial["RowParallelLinear"]) == "tp-rank"
    assert detect_kind(skill["ColumnParallelLinear"]) == "column"
    assert detect_kind(tutorial["RowParallelLinear"]) == "row"


def test_neither_convention_names_both_choices() -> None:
    with pytest.raises(InvalidArgument, match=r"fits no convention\..*pass --convention master-weight\|tp-rank\|group"):
        detect_convention(torch.nn.Linear)


def _loaded(variant, world_size: int, *, bias: bool) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 4, generator=gen, dtype=torch.float64)  # [out, in]
    master_bias = torch.randn(6, generator=gen, dtype=torch.float64) if bias else None

    def build() -> dict[str, torch.Tensor]:
        import torch.distributed as dist

        module = variant.instantiate(4, 6, bias, group=dist.group.WORLD, rank=dist.get_rank(), world_size=world_size,
                                     master_weight=weight, master_bias=master_bias, dtype=torch.float64)
        return {k: v.detach().clone() for k, v in module.named_parameters()}

    return [dict(p, master_weight=weight, master_bias=master_bias) for p in tpsim.run(build, world_size)]


def test_master_weight_column_bias_gets_its_shard_row_bias_the_whole() -> None:
    skill = _classes(SKILL)
    column = variant_from_class(skill["ColumnParallelLinear"])
    row = variant_from_class(skill["RowParallelLinear"], output="reduced")
    for rank, p in enumerate(_loaded(column, 2, bias=True)):
        assert torch.equal(p["weight"], p["master_weight"][rank * 3 : (rank + 1) * 3])  # sliced by the layer
        assert torch.equal(p["bias"], p["master_bias"][rank * 3 : (rank + 1) * 3])
    for rank, p in enumerate(_loaded(row, 2, bias=True)):
        assert torch.equal(p["weight"], p["master_weight"][:, rank * 2 : (rank + 1) * 2])
        assert torch.equal(p["bias"], p["master_bias"])


def test_tp_rank_weights_are_overwritten_with_transposed_master_shards() -> None:
    tutorial = _classes(TUTORIAL)
    column = variant_from_class(tutorial["ColumnParallelLinear"], input_grad="partial")
    row = variant_from_class(tutorial["RowParallelLinear"])
    assert column.bias is False and row.bias is False
    for rank, p in enumerate(_loaded(column, 2, bias=False)):
        assert torch.equal(p["weight"], p["master_weight"][rank * 3 : (rank + 1) * 3].t())  # [in, out/ws]
    for rank, p in enumerate(_loaded(row, 2, bias=False)):
        assert torch.equal(p["weight"], p["master_weight"][:, rank * 2 : (rank + 1) * 2].t())  # [in/ws, out]
    with pytest.raises(tpsim.RankError, match="has no bias; bias=True cannot be built"):  # raised on the rank
        _loaded(row, 1, bias=True)


def test_resolved_variants_remember_target_and_options_for_worker_processes() -> None:
    target = f"{SKILL}:RowParallelLinear"
    (variant,) = resolve_target(target, output="reduced")
    assert variant.target == target and variant.options == (("output", "reduced"),)
    again = resolve_variant(target, variant.name, variant.options)
    assert again.output == "reduced" and again.name == variant.name


def test_tpsim_layers_resolves_to_the_builtin_variants() -> None:
    # The one resolver gives every family's variants: the linear layers first, in declaration order.
    names = [v.name for v in resolve_target("tpsim.layers") if isinstance(v, Variant)]
    assert names == ["ColumnParallelLinear", "ColumnParallelLinear(gather_output=True)", "RowParallelLinear",
                     "RowParallelLinear(input_is_parallel=False)", "ColumnParallelLinear(parts=gate,up)",
                     "ColumnParallelLinear(parts=q8,k2,v2)", "ColumnParallelLinear(sequence_parallel=True)",
                     "RowParallelLinear(sequence_parallel=True)"]
    (row,) = resolve_target("tpsim.layers:RowParallelLinear")
    assert row.target == "tpsim.layers:RowParallelLinear" and row.output == "reduced"
    with pytest.raises(TargetError, match="declares no variant named 'Row'; it declares: ColumnParallelLinear"):
        resolve_target("tpsim.layers:Row")


@pytest.mark.parametrize("value, kind", [('"ColumnParallelLinear"', "str"), ("{}", "dict")])
def test_a_declared_variant_list_that_is_not_a_list_is_named(tmp_path, value, kind) -> None:
    # A string is iterable: read as a list it would "hold" its first character.
    (tmp_path / "declares.py").write_text(f"TPSIM_VARIANTS = {value}\n")
    with pytest.raises((InvalidArgument, TargetError),
                       match=rf"declares\.py: TPSIM_VARIANTS is a {kind} .*expected a list \(or tuple\) of tpsim variants"):
        resolve_target(str(tmp_path / "declares.py"))
