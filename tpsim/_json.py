"""Values made JSON-ready, for reports and case files alike (one rule, so both read the same)."""

from __future__ import annotations

from typing import Any

__all__ = ["jsonable"]


def jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it: dict keys as strings, tuples as lists, NaN and infinities as
    their names (JSON has no such numbers), anything else that is not a JSON scalar as its ``str``."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
