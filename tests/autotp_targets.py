"""Dense modules checked under DeepSpeed AutoTP (``--plan tpsim.presets.deepspeed:autotp``): correct
ones, and seeded bugs in the layers AutoTP puts in, or in where its policy puts them."""

from __future__ import annotations

import os
import sys
from typing import Any

from torch import nn

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
from plan_mlp import GatedMLP  # noqa: E402

from tpsim.presets.deepspeed import autotp  # noqa: E402

__all__ = ["GatedMLP", "LlamaMLPTiny", "MLPWithOutput", "NoRowMLP", "autotp_bias_before_reduce"]


def _tiny_llama_mlp() -> type:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    class LlamaMLPTiny(LlamaMLP):
        """Hugging Face's ``LlamaMLP`` from a tiny ``LlamaConfig`` (one attention head of an even
        ``head_dim``, which RoPE's validation asks for: the MLP's sizes are free)."""

        def __init__(self, hidden: int, ffn: int) -> None:
            super().__init__(LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_attention_heads=1,
                                         num_key_value_heads=1, head_dim=2, hidden_act="silu"))

    LlamaMLPTiny.__module__ = __name__
    LlamaMLPTiny.__qualname__ = "LlamaMLPTiny"  # found at module level: reports name it so
    return LlamaMLPTiny


LlamaMLPTiny = _tiny_llama_mlp()


class MLPWithOutput(GatedMLP):
    """A gated MLP followed by one more projection, ``out``: AutoTP's policy makes it column parallel
    (its name is no row-parallel name and no LayerNorm follows it), so its output stays sharded."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__(hidden, ffn)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: Any) -> Any:
        return self.out(super().forward(x))


class NoRowMLP(nn.Module):
    """``fc2(relu(fc1(x)))``: no name AutoTP's policy makes row parallel (AutoTP has no policy for it)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: Any) -> Any:
        return self.fc2(self.fc1(x).relu())


def autotp_bias_before_reduce(module: nn.Module, mesh: Any) -> nn.Module:
    """AutoTP with its row-parallel layer patched to add the whole bias before the all-reduce (the
    patched subclass of tests/wild/deepspeed_patches.py): ``down_proj: bias-duplication``."""
    import deepspeed.module_inject.auto_tp as auto_tp

    from tpsim.target import import_target_module

    patches = import_target_module(os.path.join(os.path.dirname(os.path.abspath(__file__)), "wild",
                                                "deepspeed_patches.py"))
    auto_tp.LinearAllreduce = patches.BiasBeforeReduceLinearAllreduce  # this rank's auto_tp (rank-local)
    return autotp(module, mesh)


autotp_bias_before_reduce.rank_local = (*autotp.rank_local, "deepspeed.module_inject.auto_tp")  # type: ignore[attr-defined]
autotp_bias_before_reduce.uneven_sizes_are_cases = True  # type: ignore[attr-defined]
