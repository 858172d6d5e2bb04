"""The attention family (tpsim/props/attention) and attention blocks checked as whole modules.

The layer is checked against its dense twin in tests/test_layers_attention.py; here the harness is
under test: tpsim's ParallelAttention passes in every dtype (GQA with sharded and replicated key/value heads,
causal or not, with and without sequence parallelism), head counts the tp size cannot split must
be refused clearly, the attention mutants are named with their diagnoses (tests/test_mutants.py
runs the catalog), a case file replays on gloo, and a user's attention block passes
``tpsim check --kind module`` (the magnitude rule of ``scaled_dot_product_attention``).
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from helpers import assert_case_replays_on_gloo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from tpsim import builtin_variants
from tpsim.attention_variant import AttentionVariant
from tpsim.cli import main
from tpsim.errors import InvalidArgument
from tpsim.props.attention.case import AttentionCase
from tpsim.props.attention.checks import divides
from tpsim.props.attention.family import ATTENTION
from tpsim.props.attention.strategies import attention_cases
from tpsim.props.module.magnitude import _RULES
from tpsim.props.search import search

FAST = {"max_examples": 40, "seed": 0, "world_sizes": (1, 2, 4)}


def test_case_round_trips_and_refuses_bad_fields():
    case = AttentionCase(4, 6, 8, 2, 3, 4, (2,), causal=False, bias=False, dtype="float32", seed=3, tp_size=2,
                         tp_layout="strided")
    data = json.loads(json.dumps(case.to_dict()))
    assert AttentionCase.from_dict(data) == case and ATTENTION.case_from_dict(data) == case
    with pytest.raises(InvalidArgument, match="num_heads=0 must be an int >= 1"):
        AttentionCase(2, 4, 0, 1, 2, 2)
    with pytest.raises(InvalidArgument, match="causal='yes' must be true or false"):
        AttentionCase(2, 4, 2, 1, 2, 2, causal="yes")


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_strategy_draws_replicated_and_unsplittable_heads(data):
    case = data.draw(attention_cases(builtin_variants.attention, world_sizes=(4,), dtypes=("float64",)))
    tp, h, g = case.tp_size, case.num_heads, case.num_kv_heads
    assert h % g == 0, case
    if divides(case):
        assert h % tp == 0 and (g % tp == 0 or tp % g == 0)


def test_the_strategy_reaches_every_layout():
    seen = set()

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(attention_cases(builtin_variants.attention_sequence_parallel, world_sizes=(4,), dtypes=("float64",)))
    def collect(case):
        assert case.seq % case.tp_size == 0  # sequence parallelism: the sequence divides
        if not divides(case):
            seen.add("unsplittable")
        elif case.num_kv_heads < case.tp_size:
            seen.add("replicated")
        else:
            seen.add("sharded")

    collect()
    assert seen == {"unsplittable", "replicated", "sharded"}


@pytest.mark.parametrize("variant", [builtin_variants.attention, builtin_variants.attention_sequence_parallel],
                         ids=lambda v: v.name)
def test_tpsim_attention_passes_in_every_dtype(variant):
    report = search(variant, **FAST, dtypes=("float64", "float32", "bfloat16", "float16"))
    assert report.passed, [f.describe() for f in report.failures]
    assert not any("only" in n for n in report.notes)  # judged by the dense twin: no dtype is left out


def test_a_block_that_accepts_heads_it_cannot_split_is_divisibility_unchecked():
    anything = AttentionVariant("accepts-anything", build=lambda *a, **k: nn.Identity())
    case = AttentionCase(2, 4, 3, 1, 2, 2)  # 3 query heads on 2 ranks
    failures = ATTENTION.check_case(anything, case, backend="inproc")
    assert [(f.property, f.diagnosis) for f in failures] == [("divisibility", "divisibility-unchecked")]
    refused = ATTENTION.check_case(builtin_variants.attention, case, backend="inproc")
    assert refused == []  # ParallelAttention refuses it on every rank, naming num_heads


@pytest.mark.gloo
def test_an_attention_case_replays_on_gloo(capsys, tmp_path):
    assert_case_replays_on_gloo(capsys, tmp_path, "tpsim.mutants:attention_local_head_dim_scale", "attention",
                                "forward-equivalence: attention-scale")


# --- a user's attention block as a whole module -------------------------------------------------------

USER_BLOCK = textwrap.dedent('''
    from torch import nn

    from tpsim.layers import ParallelAttention


    class MyAttention(nn.Module):
        """A user's block: tpsim's head-sharded attention with a fixed head dim, a group keyword."""

        def __init__(self, hidden, num_heads, *, process_group=None, dtype=None):
            super().__init__()
            self.attn = ParallelAttention(hidden, num_heads, head_dim=2, group=process_group, dtype=dtype)

        def forward(self, x):
            # a single token (a 1-D input) is a sequence of one
            return self.attn(x.unsqueeze(0)).squeeze(0) if x.dim() == 1 else self.attn(x)
''')


def test_sdpa_has_a_magnitude_rule_in_every_magnitude_run():
    # Registered by the first magnitude run (not when a family is imported: no import-time side effect).
    from tpsim.props.module.magnitude import MagnitudeMode

    MagnitudeMode()
    assert "scaled_dot_product_attention" in _RULES


def test_a_user_attention_block_passes_as_a_whole_module(capsys, tmp_path):
    path = tmp_path / "my_attention.py"
    path.write_text(USER_BLOCK)
    code = main(["check", f"{path}:MyAttention", "--kind", "module", "--max-examples", "30", "--world-sizes", "1,2,4",
                 "--seed", "0", "--cases-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASS MyAttention" in out


def test_the_magnitude_rule_bounds_the_attention_of_a_module():
    """The rule's forward bound is at least the attention's value on the magnitudes (p <= 1)."""
    q, k, v = (torch.rand(2, 3, 4, dtype=torch.float64) for _ in range(3))
    from tpsim.props.attention.magnitude import _SDPAMagnitude

    bound = _SDPAMagnitude.apply(q, k, v, 0.5, True, 1)
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    assert bool((bound >= exact.abs()).all())
