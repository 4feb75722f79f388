"""``AfterCommit``: what an adapter's framework asks for during a save (a link, a removal, an upload, a logger call)
runs once that save is committed, never after a failed one (older checkpoints stay in place)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["AfterCommit"]

log = logging.getLogger(__name__)


class AfterCommit:
    """Actions run once :attr:`handle` (the save in flight; the adapter sets it) is committed; one thread uses it.

    An action runs at once when nothing is in flight, else at :meth:`poll` or :meth:`run` after the commit, lower
    ``order`` first; its ``OSError`` is logged, but raised for a negative ``order`` (an upload; the rest dropped).
    """

    def __init__(self) -> None:
        self.handle: Any = None  # a torch_ckpt.SaveHandle, or None
        self._pending: list[tuple[int, str, Callable[[], None]]] = []

    @property
    def saving(self) -> bool:  # the tracked save is not finished
        return self.handle is not None and not self.handle.committed.done()

    @property
    def pending(self) -> list[str]:  # what waits, in the words given to add()
        return [what for _, what, _ in self._pending]

    def add(self, order: int, what: str, action: Callable[[], None]) -> None:
        """Run ``action`` (described by ``what``) now if no save is in flight, else after its commit."""
        if self.saving:
            self._pending.append((order, what, action))
        else:
            action()

    def poll(self) -> None:  # run() if the tracked save has finished
        if self._pending and not self.saving:
            self.run()

    def run(self) -> None:
        """Wait for the tracked save, then run the waiting actions once (none if it failed); raises the ``OSError``
        of an action of negative order."""
        if self._pending and self.handle is not None and self.handle.committed.exception() is not None:
            log.warning("the last save failed: not carrying out %s, so older checkpoints stay", self.pending)
            self._pending = []
        pending, self._pending = sorted(self._pending, key=lambda p: p[0]), []
        for order, what, action in pending:
            try:
                action()
            except OSError as exc:
                if order < 0:
                    raise
                log.warning("after a commit: could not %s: %s", what, exc)
