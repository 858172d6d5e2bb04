"""Generated regions inside hand-written markdown: the prose stays the author's, the tables the code's.

A region is delimited by two HTML comments (invisible when the page is rendered)::

    <!-- BEGIN GENERATED cli-check-options (python -m tools.docs) -->
    ...whatever the renderer of "cli-check-options" returns...
    <!-- END GENERATED cli-check-options -->

:func:`fill` replaces the body of every region with its renderer's text; a region without a
renderer is an error, so a renamed table cannot silently stay stale.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

__all__ = ["RegionError", "fill", "region_names"]

_REGION = re.compile(
    r"(?P<begin><!-- BEGIN GENERATED (?P<name>[\w.-]+)[^>]*-->\n)(?P<body>.*?)(?P<end><!-- END GENERATED (?P=name) -->)",
    re.S,
)


class RegionError(ValueError):
    """A document's generated regions do not match the renderers (unknown or unclosed region)."""


def region_names(text: str) -> list[str]:
    """The names of the generated regions in ``text``, in order."""
    return [m.group("name") for m in _REGION.finditer(text)]


def fill(text: str, renderers: Mapping[str, Callable[[], str]], *, where: str = "document") -> str:
    """``text`` with the body of each generated region replaced by its renderer's output."""
    opened = len(re.findall(r"<!-- BEGIN GENERATED ", text))
    if opened != len(region_names(text)):
        raise RegionError(f"{where}: a '<!-- BEGIN GENERATED name -->' has no matching '<!-- END GENERATED name -->'")

    def replace(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in renderers:
            raise RegionError(f"{where}: no renderer for the generated region {name!r}; known: {', '.join(renderers)}")
        body = renderers[name]().rstrip("\n") + "\n"
        return m.group("begin") + body + m.group("end")

    return _REGION.sub(replace, text)
