"""A griffe extension for the API reference: Sphinx roles in docstrings shown as code.

The docstrings cross-reference with Sphinx roles (``:class:`~speedtronic.data.DataSource```),
which Markdown would print as they are. This turns each role into an inline code span of its
target (the last component when the target starts with ``~``, as Sphinx shows it).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(
    r":(?:py:)?(?:mod|class|func|meth|attr|data|exc|obj|const|type):`(~?)([^`<]+?)(?:\s*<[^>]*>)?`"
)


def shown(match: re.Match[str]) -> str:
    """The code span for one role: ``~a.b.C`` -> `C`, ``a.b.C`` -> `a.b.C`."""
    tilde, target = match.groups()
    target = target.strip()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrite the roles in every docstring as soon as its object is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(shown, obj.docstring.value)
