"""Progress bars for long loads, downloads, conversions and verification: tqdm on a terminal, silent elsewhere."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["progress_bar"]


class _NullBar:
    def update(self, n: int = 1) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> _NullBar:
        return self

    def __exit__(self, *exc: object) -> None: ...


def progress_bar(total: int, desc: str, *, enabled: bool = True, unit: str = "B") -> Any:
    """A tqdm bar on stderr when ``enabled`` and stderr is a terminal; otherwise a silent stand-in.

    Both have ``update(n)``, ``close()`` and work as context managers.
    """
    if not enabled or not sys.stderr.isatty():
        return _NullBar()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is optional
        return _NullBar()
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024, leave=False,
                file=sys.stderr, dynamic_ncols=True)
