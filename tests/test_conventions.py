"""The constructor conventions read from the signature *and* the built module: the ``group``
convention (Megatron style), tuple outputs and ``skip_bias_add``, always-on biases, forced
conventions that do not fit (a usage error, no case file), rank-local module state
(``--rank-local``, automatic for the class's module, ``SharedModuleState`` as exit 2) and
``--param-grad``."""

from __future__ import annotations

import pathlib
import textwrap

import pytest
import torch

import tpsim
from tpsim.cli import main
from tpsim.conventions import HOW_TO_CHECK, add_returned_bias, detect_convention, variant_from_class
from tpsim.errors import InvalidArgument
from tpsim.props.search import search
from tpsim.target import module_name_of_path, resolve_target

ROOT = pathlib.Path(__file__).resolve().parent.parent
WILD = ROOT / "tests" / "wild"
MEGATRON_STYLE = str(WILD / "megatron_style.py")
ALWAYS_BIAS = str(WILD / "always_bias.py")
FAST = ["--max-examples", "12", "--world-sizes", "1,2,3", "--seed", "0"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _class(path: str, name: str) -> type:
    import sys

    resolve_target(path + ":" + name)
    return getattr(sys.modules[module_name_of_path(path)], name)


# --- the group convention ----------------------------------------------------------------------


@pytest.mark.parametrize("name, keyword", [("ColumnParallelLinear", "tp_group"), ("RowParallelLinear", "process_group"),
                                           ("ProjectionRowLinear", "group")])
def test_group_convention_is_detected_by_its_keyword_and_size_names(name: str, keyword: str) -> None:
    cls = _class(MEGATRON_STYLE, name)
    assert detect_convention(cls) == "group"
    (variant,) = resolve_target(f"{MEGATRON_STYLE}:{name}")
    assert f"tp group by {keyword}=" in variant.description
    assert [(p.name, str(p.placement), p.transposed, p.load) for p in variant.params or ()] == (
        [("weight", "S(0)", False, True), ("bias", "S(0)", False, True)] if variant.kind == "column"
        else [("weight", "S(1)", False, True), ("bias", "R", False, True)]
    )


def test_a_class_that_fits_no_convention_is_sent_to_the_readme_section() -> None:
    with pytest.raises(InvalidArgument) as info:
        detect_convention(torch.nn.Linear)
    text = str(info.value)
    assert "fits no convention" in text and "--convention master-weight|tp-rank|group" in text
    assert "README.md, section 'Check your own layer'" in text and HOW_TO_CHECK in text


def test_group_options_follow_the_placements() -> None:
    column = _class(MEGATRON_STYLE, "ColumnParallelLinear")

    def build_one(variant):
        def rank() -> None:
            import torch.distributed as dist

            w = torch.arange(8.0).reshape(4, 2)
            m = variant.instantiate(2, 4, True, group=dist.group.WORLD, rank=dist.get_rank(), world_size=2,
                                    master_weight=w, master_bias=torch.ones(4), dtype=torch.float64)
            return m.gather_output, m.sequence_parallel, m.weight.detach().clone(), m.bias.detach().clone()

        return tpsim.run(rank, 2)

    gathered = variant_from_class(column, output="gathered")
    (g0, sp0, w0, b0), (_, _, w1, _) = build_one(gathered)
    assert (g0, sp0) == (True, False)
    # Its own random init is overwritten with the master shards, in the case's dtype.
    assert torch.equal(w0, torch.arange(8.0, dtype=torch.float64).reshape(4, 2)[:2])
    assert torch.equal(w1, torch.arange(8.0, dtype=torch.float64).reshape(4, 2)[2:])
    assert torch.equal(b0, torch.ones(2, dtype=torch.float64))
    sequence = variant_from_class(column, input="sequence-sharded")
    assert sequence.sequence_dim == 0  # Megatron's [s, b, h]
    (g, sp, _, _), _ = build_one(sequence)
    assert (g, sp) == (False, True)


def test_group_classes_pass_with_tuple_outputs_and_skip_bias_add(capsys, tmp_path) -> None:
    code, out, err = run(capsys, "check", MEGATRON_STYLE + ":ProjectionRowLinear", *FAST, "--cases-dir", str(tmp_path))
    assert code == 0, out + err  # skip_bias_add=True by default: tpsim adds the returned bias
    code, out, err = run(capsys, "check", MEGATRON_STYLE + ":ColumnParallelLinear", "--output", "gathered", *FAST,
                         "--cases-dir", str(tmp_path))
    assert code == 0, out + err


def test_add_returned_bias_adds_what_skip_bias_add_leaves_to_the_caller() -> None:
    class Returns(torch.nn.Module):
        def __init__(self, value):
            super().__init__()
            self.value = value

        def forward(self, x):
            return self.value

    x = torch.zeros(1)
    y = torch.ones(2, 3)
    assert torch.equal(add_returned_bias(Returns(y), x), y)
    assert torch.equal(add_returned_bias(Returns((y, None)), x), y)
    assert torch.equal(add_returned_bias(Returns((y, torch.arange(3.0))), x), y + torch.arange(3.0))
    with pytest.raises(ValueError, match=r"returned a bias of shape \[1\] with an output of shape \[2, 3\]"):
        add_returned_bias(Returns((y, torch.ones(1))), x)  # a bias shard beside a gathered output
    with pytest.raises(TypeError, match="returned a tuple of 3 item"):
        add_returned_bias(Returns((y, None, None)), x)


# --- the bias, read from the built module ------------------------------------------------------


def test_a_class_that_always_builds_a_bias_runs_biased_cases_with_it_loaded() -> None:
    (column,) = resolve_target(ALWAYS_BIAS + ":ColumnParallelLinear")
    assert column.bias and column.always_bias
    assert any("always builds a bias" in n for n in column.notes)
    report = search(column, max_examples=25, seed=0, world_sizes=(1, 2, 3))
    assert report.passed, [f.message for f in report.failures]

    def rank():
        import torch.distributed as dist

        m = column.instantiate(2, 4, True, group=dist.group.WORLD, rank=dist.get_rank(), world_size=2,
                               master_weight=torch.zeros(4, 2), master_bias=torch.arange(4.0), dtype=torch.float32)
        return m.bias.detach().clone()

    b0, b1 = tpsim.run(rank, 2)
    assert b0.tolist() == [0.0, 1.0] and b1.tolist() == [2.0, 3.0]  # its random init overwritten


def test_a_class_without_any_bias_stays_bias_free() -> None:
    (row,) = resolve_target(str(ROOT / "examples" / "tutorial_convention.py") + ":RowParallelLinear")
    assert not row.bias and not row.always_bias
    assert row.notes == ("RowParallelLinear has no bias parameter: bias-free cases only",)


# --- forced conventions --------------------------------------------------------------------------


def test_a_forced_convention_that_does_not_fit_is_a_usage_error_with_no_case_file(capsys, tmp_path) -> None:
    cases = tmp_path / "cases"
    code, out, err = run(capsys, "check", str(ROOT / "examples" / "tutorial_convention.py") + ":RowParallelLinear",
                         "--convention", "master-weight", *FAST, "--cases-dir", str(cases))
    assert code == 2, out + err
    assert "--convention master-weight does not fit RowParallelLinear(in_features, out_features, tp_size, tp_rank, " \
           "tp_group)" in err
    assert "it has no parameter master_weight" in err
    assert "it requires tp_size, tp_rank, which the convention does not pass" in err
    assert not cases.exists() or not list(cases.iterdir())
    code, out, err = run(capsys, "check", MEGATRON_STYLE + ":ColumnParallelLinear", "--convention", "tp-rank",
                         *FAST, "--cases-dir", str(cases))
    assert code == 2 and "it has no parameter tp_size, tp_rank" in err


# --- rank-local module state ---------------------------------------------------------------------


def test_the_module_that_defines_a_class_is_rank_local() -> None:
    (variant,) = resolve_target(ALWAYS_BIAS + ":RowParallelLinear")
    assert variant.rank_local == (module_name_of_path(ALWAYS_BIAS),)
    (tpsim_own,) = resolve_target("tpsim.layers:RowParallelLinear")
    assert tpsim_own.rank_local == ()


STATE = '''
import torch.distributed as dist

GROUP = None


def initialize(group):
    global GROUP
    dist.barrier(group=group)
    GROUP = group
'''

LAYERS = '''
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mylib import tp_state


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=tp_state.GROUP)
        return grad


class StatefulColumnLinear(nn.Module):
    def __init__(self, input_size, output_size, *, bias=True, tp_group=None):
        super().__init__()
        tp_state.initialize(tp_group)
        size = dist.get_world_size(group=tp_state.GROUP)
        if output_size % size:
            raise ValueError(f"output_size={output_size} is not divisible by {size}")
        self.weight = nn.Parameter(torch.empty(output_size // size, input_size).normal_())
        self.bias = nn.Parameter(torch.zeros(output_size // size)) if bias else None

    def forward(self, x):
        return F.linear(_Copy.apply(x), self.weight, self.bias)
'''


def test_shared_module_state_is_exit_2_naming_the_fix_and_rank_local_fixes_it(capsys, tmp_path, monkeypatch) -> None:
    # The layer's tp group lives in another module of its package than the class (as fairscale's
    # does): the class's module is rank-local automatically, the state's is not.
    package = tmp_path / "mylib"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "tp_state.py").write_text(textwrap.dedent(STATE))
    (package / "layers.py").write_text(textwrap.dedent(LAYERS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["check", "mylib.layers:StatefulColumnLinear", "--world-sizes", "2", "--max-examples", "5", "--seed", "0",
            "--cases-dir", str(tmp_path / "cases")]
    code, out, err = run(capsys, *argv)
    assert code == 2, out + err
    assert "mylib.tp_state.GROUP" in err and "--rank-local mylib.tp_state" in err and "gloo" in err
    assert not (tmp_path / "cases").exists()
    code, out, err = run(capsys, *argv, "--rank-local", "mylib.tp_state")
    assert code == 0, out + err


def test_rank_local_names_a_target_file_by_its_path(capsys, tmp_path) -> None:
    (variant,) = resolve_target(ALWAYS_BIAS + ":ColumnParallelLinear", rank_local=(MEGATRON_STYLE,))
    assert variant.rank_local == (module_name_of_path(ALWAYS_BIAS), module_name_of_path(MEGATRON_STYLE))
    code, out, err = run(capsys, "check", ALWAYS_BIAS + ":ColumnParallelLinear", "--rank-local", "no_such_module_x",
                         *FAST, "--cases-dir", str(tmp_path))
    assert code == 2 and "--rank-local no_such_module_x: cannot import module 'no_such_module_x'" in err


# --- trainer-reduced grads -----------------------------------------------------------------------

UNMARKED = '''
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = dist.get_world_size(group)
        if x.shape[0] % n:
            raise ValueError(f"sequence length {x.shape[0]} is not divisible by {n}")
        out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype)
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, 0), None


class SequenceRowLinear(nn.Module):
    """Sequence-parallel row layer whose bias grad the trainer sums; it carries no marker."""

    def __init__(self, input_size, output_size, *, bias=True, sequence_parallel=False, group=None):
        super().__init__()
        n = dist.get_world_size(group)
        if input_size % n:
            raise ValueError(f"input_size={input_size} is not divisible by {n}")
        self.group = group
        self.weight = nn.Parameter(torch.empty(output_size, input_size // n).normal_())
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None

    def forward(self, x):
        y = _ReduceScatter.apply(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y
'''


def test_param_grad_partial_declares_a_trainer_reduced_grad(capsys, tmp_path, monkeypatch) -> None:
    (tmp_path / "seqrow.py").write_text(textwrap.dedent(UNMARKED))
    monkeypatch.chdir(tmp_path)
    # Seed 3: its first case with a bias has distinct rows. On an expanded input (identical rows, see
    # tpsim.props.layouts) each rank's share of the bias grad is exactly 1/tp of it, which the
    # recognisers name grad-scaled instead (the values cannot tell the two apart).
    argv = ["check", "seqrow.py:SequenceRowLinear", "--output", "sequence-sharded", "--world-sizes", "2",
            "--dtypes", "float64", "--max-examples", "15", "--seed", "3", "--cases-dir", str(tmp_path / "cases")]
    code, out, err = run(capsys, *argv)
    assert code == 1 and "grad-not-reduced" in out  # undeclared: the bias grad must be complete
    code, out, err = run(capsys, *argv, "--param-grad", "bias=partial")
    assert code == 0, out + err
    (variant,) = resolve_target(str(tmp_path / "seqrow.py") + ":SequenceRowLinear", output="sequence-sharded",
                                param_grad=(("bias", "partial"),))
    assert variant.param("bias").grad == "partial"
    code, out, err = run(capsys, *argv, "--param-grad", "offset=partial")
    assert code == 2 and "no variant has a parameter named 'offset'; the parameters are: bias, weight" in err
    code, out, err = run(capsys, *argv, "--param-grad", "bias")
    assert code == 2 and "expected NAME=partial" in err
