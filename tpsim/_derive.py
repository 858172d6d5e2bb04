"""Variants derived from a resolved one: the field changes worker processes must apply too.

A variant reaches worker processes (gloo ranks, the isolated inproc worker) as the reference
``(target, name, options)`` they resolve again (:mod:`tpsim.props.launch`). A variant the harness
derives after resolving it — ``variant.replace(params=...)`` to confirm a diagnosis, ``forward_only``
for a forward-only suite — is not what that reference resolves to. So every variant class's
``replace`` goes through :func:`replace`, which remembers the fields it changed (their values,
latest last) on the copy; :func:`resolved` marks a variant as exactly what its reference resolves
to (the target resolver does, last); and the reference carries :func:`changes`, which the workers
apply with ``replace`` after resolving. A copy made with :func:`dataclasses.replace` directly
remembers nothing: derive with the variant's own ``replace``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, TypeVar

__all__ = ["changes", "replace", "resolved"]

_ATTR = "_tpsim_changes"
T = TypeVar("T")


def changes(variant: Any) -> tuple[tuple[str, Any], ...]:
    """The ``(field, value)`` changes made to ``variant`` since it was resolved, in order."""
    return tuple(getattr(variant, _ATTR, ()))


def replace(variant: T, fields: dict[str, Any]) -> T:
    """``dataclasses.replace(variant, **fields)`` that remembers ``fields`` on the copy."""
    new = dataclasses.replace(variant, **fields)  # type: ignore[type-var]
    merged = {k: v for k, v in changes(variant) if k not in fields}
    merged.update(fields)
    object.__setattr__(new, _ATTR, tuple(merged.items()))
    return new


def resolved(variant: T) -> T:
    """``variant`` as its reference resolves it: itself when it remembers no change, else a copy
    that remembers none."""
    if not changes(variant):
        return variant
    new = copy.copy(variant)
    object.__setattr__(new, _ATTR, ())
    return new
