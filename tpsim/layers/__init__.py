"""The tensor-parallel layer core: autograd-aware collective regions and parallel layers.

Backend-agnostic: only the public ``torch.distributed`` API with an explicit process group
(``group=None`` is the default world group, resolved when a layer is built), so the same classes
run under torchrun on NCCL or gloo and on tpsim's in-process backend. Nothing here imports the
rest of tpsim.

>>> from tpsim.layers import ColumnParallelLinear, RowParallelLinear, ParallelMLP
>>> from tpsim.layers import VocabParallelEmbedding, vocab_parallel_cross_entropy, ParallelAttention
"""

from tpsim.layers.attention import DenseAttention, ParallelAttention, QKVParallelLinear
from tpsim.layers.linear import ColumnParallelLinear, RowParallelLinear
from tpsim.layers.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from tpsim.layers.mlp import ACTIVATIONS, GATED_ACTIVATIONS, DenseMLP, ParallelMLP
from tpsim.layers.norm import LayerNorm, RMSNorm
from tpsim.layers.vocab import (
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    padded_vocab_size,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
)

__all__ = [
    "ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "ColumnParallelLinear",
    "DenseAttention",
    "DenseMLP",
    "LayerNorm",
    "ParallelAttention",
    "ParallelMLP",
    "QKVParallelLinear",
    "RMSNorm",
    "RowParallelLinear",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "padded_vocab_size",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_linear_cross_entropy",
]
