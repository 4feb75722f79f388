"""Preemption signals (SIGTERM, or SIGUSR1 on SLURM) turned into one emergency save at a step boundary.

The handler only records the signal; the manager polls the flag at the next ``should_save`` /
``save_if_due`` (a signal on any rank counts for all), saves, waits for the commit (up to a timeout)
and exits with ``128 + signum``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

from torch_ckpt._logging import get_logger
from torch_ckpt.errors import ConfigError

__all__ = ["PreemptionFlag", "parse_signals"]

log = get_logger(__name__)


def parse_signals(signals: Iterable[str | int | signal.Signals]) -> list[signal.Signals]:
    """``["SIGTERM", "USR1", 15]`` as ``signal.Signals``; :class:`ConfigError` for an unknown one."""
    out = []
    for s in signals:
        try:
            out.append(signal.Signals[s.upper() if s.upper().startswith("SIG") else "SIG" + s.upper()]
                       if isinstance(s, str) else signal.Signals(s))
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"unknown preemption signal {s!r}; use names such as 'SIGTERM' or 'SIGUSR1'") from exc
    return out


class PreemptionFlag:
    """Handlers for ``signals`` that record the first one received (installed only from the main thread,
    else a warning; :meth:`trigger` still works). :meth:`restore` puts the previous handlers back."""

    def __init__(self, signals: Iterable[str | int | signal.Signals]) -> None:
        self.signals = parse_signals(signals)
        self.received: signal.Signals | None = None
        #: set by the manager's ``should_save``: something polls this flag at step boundaries
        self.polled = False
        self._warned = False
        self._previous: dict[signal.Signals, Any] = {}
        if not self.signals:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption handlers for %s not installed: not on the main thread",
                        [s.name for s in self.signals])
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:  # noqa: ARG002 - signal handler signature
        self.trigger(signal.Signals(signum))

    def trigger(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Set the flag as if ``sig`` had arrived."""
        if self.received is None:
            self.received = sig

    def warn_if_unheeded(self) -> None:
        """Log once when a signal arrived but nothing polled the flag: the handler replaced the signal's own
        action (SIGTERM: terminate), so it would be ignored without a trace. Called by ``save()``."""
        if self.received is None or self.polled or self._warned:
            return
        self._warned = True
        log.warning("%s received, but preemption_signals act only at should_save()/save_if_due(), which this run "
                    "never called: no emergency save and no exit, training goes on (the handler replaced the "
                    "signal's own action). Call mgr.save_if_due(step, state) once per step instead of only save(), "
                    "or leave preemption_signals out", self.received.name)

    @property
    def requested(self) -> bool:
        """True once a preemption signal arrived."""
        return self.received is not None

    def restore(self) -> None:
        """Reinstate the handlers that were active before."""
        for sig, handler in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):  # not on the main thread any more
                signal.signal(sig, handler)
        self._previous.clear()
