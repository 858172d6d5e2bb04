"""The repository's own tooling (not installed with tpsim): ``python -m tools.docs`` regenerates the docs."""
