"""``AfterCommit``: work that must wait until the save in flight is committed (links, removals, uploads, loggers).

An adapter whose framework asks for a link, a deletion or a notification while the previous save is still being
written hands it here; it runs at once when nothing is in flight, else at the next :meth:`~AfterCommit.poll` or
:meth:`~AfterCommit.run` after the commit, in ``order``. When that save failed nothing runs (older checkpoints
stay in place). Use it from one thread (the training thread).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch_ckpt.handle import SaveHandle

__all__ = ["AfterCommit"]

log = logging.getLogger(__name__)


class AfterCommit:
    """A queue of actions run once the tracked save is committed.

    ``order``: lower runs first; an action of negative order (an upload) raises its ``OSError`` and drops what
    follows, the others are logged and skipped.
    """

    def __init__(self) -> None:
        self.handle: SaveHandle | None = None  # the save in flight (set by the adapter at each save)
        self._pending: list[tuple[int, str, Callable[[], None]]] = []

    @property
    def saving(self) -> bool:
        """True while the tracked save is not finished."""
        return self.handle is not None and not self.handle.committed.done()

    @property
    def pending(self) -> list[str]:
        """What is waiting, in the words given to :meth:`add`."""
        return [what for _, what, _ in self._pending]

    def add(self, order: int, what: str, action: Callable[[], None]) -> None:
        """Run ``action`` now if no save is in flight, else once it is committed."""
        if self.saving:
            self._pending.append((order, what, action))
        else:
            action()

    def poll(self) -> None:
        """Run the waiting actions if the tracked save has finished."""
        if self._pending and not self.saving:
            self.run()

    def run(self) -> None:
        """Wait for the tracked save, then run the waiting actions once (none if it failed).

        Raises:
            OSError: an action of negative order failed (nothing after it runs).
        """
        if self._pending and self.handle is not None:
            try:
                self.handle.committed.result()
            except Exception:  # noqa: BLE001 - the save's own error is raised by its waiter
                log.warning("the last save failed: not carrying out %s, so older checkpoints stay in place",
                            self.pending)
                self._pending = []
                return
        pending, self._pending = sorted(self._pending, key=lambda p: p[0]), []
        for order, what, action in pending:
            try:
                action()
            except OSError as exc:
                if order < 0:
                    raise
                log.warning("after a commit: could not %s: %s", what, exc)

    def clear(self) -> None:
        """Drop every waiting action."""
        self._pending = []
