"""MkDocs hook: render the Sphinx roles of the docstrings (``:class:`~a.B```) as plain code in the API pages.

The docstrings use Sphinx cross-reference roles; mkdocstrings renders them as the role's name followed by
the code, e.g. ``:class:<code>~torch_ckpt.config.CheckpointConfig</code>``. This keeps the code and drops
the role, and a leading ``~`` keeps only the last component of the name, as Sphinx shows it.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):<code>(~?)([^<]*)</code>")


def _plain(match: re.Match) -> str:
    name = match.group(2)
    return f"<code>{name.rsplit('.', 1)[-1] if match.group(1) else name}</code>"


def on_page_content(html: str, **kwargs) -> str:
    """Replace each rendered role by its code."""
    return _ROLE.sub(_plain, html)
