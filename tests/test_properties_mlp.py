"""The parallel MLP at the lab note's scale (hidden 4096, intermediate 11008, tp 2, float32) matches
the dense float64 MLP, forward and gradients, on inproc in seconds; the same check catches a
broken MLP at small scale."""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from torch import nn

from tpsim.errors import InvalidArgument
from tpsim.mutants.column import ColumnNoBackwardReduce, CorrectColumn
from tpsim.mutants.row import CorrectRow, RowBiasBeforeReduce
from tpsim.props.mlp import TPSIM_MLP, MLPVariant, check_mlp


def test_lab_note_scale_mlp_is_equivalent_forward_and_backward() -> None:
    failures = check_mlp(TPSIM_MLP, hidden=4096, intermediate=11008, world_size=2, dtype="float32",
                         batch_shape=(2, 3), bias=True, seed=0)
    assert failures == [], [f.describe() for f in failures]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_small_mlp_is_equivalent(world_size, dtype, activation) -> None:
    failures = check_mlp(TPSIM_MLP, hidden=12, intermediate=24, world_size=world_size, dtype=dtype,
                         activation=activation, seed=world_size, batch_shape=(3, 1, 2), bias=world_size != 3)
    assert failures == [], [f.describe() for f in failures]


def _composed(column: type, row: type) -> MLPVariant:
    class MLP(nn.Module):
        def __init__(self, hidden, intermediate, bias, masters, group):
            super().__init__()
            self.fc1 = column(hidden, intermediate, bias, masters["w1"].clone(), group=group)
            self.fc2 = row(intermediate, hidden, bias, masters["w2"].clone(), group=group)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))

    def build(hidden, intermediate, bias, *, group, masters, **_):
        return MLP(hidden, intermediate, bias, masters, group)

    return MLPVariant(f"{column.__name__}+{row.__name__}", build)


def test_the_mlp_check_passes_a_correct_composition_and_names_broken_ones() -> None:
    assert check_mlp(_composed(CorrectColumn, CorrectRow), hidden=8, intermediate=16, world_size=2) == []
    failures = check_mlp(_composed(ColumnNoBackwardReduce, CorrectRow), hidden=8, intermediate=16, world_size=2)
    assert [(f.property, f.diagnosis) for f in failures] == [("input-grad-equivalence", "grad-not-reduced")]
    # The skill's row layer returns a summand for the caller to reduce: inside an MLP nobody does.
    failures = check_mlp(_composed(CorrectColumn, RowBiasBeforeReduce), hidden=8, intermediate=16, world_size=2,
                         bias=False)
    assert ("forward-equivalence", "missing-reduction") in [(f.property, f.diagnosis) for f in failures]


def test_mlp_check_options_are_validated() -> None:
    with pytest.raises(InvalidArgument, match="activation='relu'; the MLP check supports gelu, silu"):
        check_mlp(hidden=4, intermediate=4, world_size=1, activation="relu")
