"""How large the sizes a search draws get (a leaf: the family base, the strategies and the CLI read it)."""

__all__ = ["DEFAULT_MAX_SIZE"]

#: The largest size per rank a sharded dim draws by default (``tpsim check --max-size``): past the
#: tiles, chunks and vector widths kernels work in (4, 8, 16, 32, 64).
DEFAULT_MAX_SIZE = 64
