"""pytest plugin of ``make test-suites``: injects our plugins into the frameworks' own tests and records each test.

Loaded with ``-p peer_suites.inject`` into every run, plain or injected, so both runs are observed alike.

* ``PEER_SUITES_INJECT=lightning``: every ``lightning.pytorch.Trainer`` built gets
  ``lightning_ckpt.AsyncDCPCheckpointIO()`` appended to its ``plugins``, unless the test already passes a
  ``CheckpointIO`` (in ``plugins`` or on a ``Strategy`` instance): that Trainer is left as it is and the
  reason recorded. ``PEER_SUITES_INJECT=accelerate``: ``accelerate_ckpt.attach(accelerator)`` is called at
  the end of every ``accelerate.Accelerator.__init__``. Unset or empty: nothing is injected (the plain run).
* ``PEER_SUITES_RECORD=PATH``: one JSON line per test is appended to ``PATH`` after its teardown, with
  ``nodeid``, ``outcome``, ``injected`` (Trainers/Accelerators that got the plugin), ``own_io`` (reasons
  for leaving one alone), ``zombies`` (names of torch-ckpt threads and writer processes started during the
  test and alive after its teardown), ``lost`` (local paths saved through a Lightning ``CheckpointIO``
  during the test, not removed through it, whose folder still exists but which do not) and
  ``lock_conflict`` (the test raised torch-ckpt's "in use by another run" error), ``dirs_at_failure`` (the
  paths a failed assertion names that were directories when it failed). A ``start`` line is
  written before each test, so a process killed by its time limit still names the test it hung in.

Hangs are caught by pytest-timeout (the runner passes ``--timeout``).
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import re
import sys
import threading
import time
from typing import Any

import pytest

ENV_INJECT = "PEER_SUITES_INJECT"
ENV_RECORD = "PEER_SUITES_RECORD"
FRAMEWORKS = ("lightning", "accelerate")
THREAD_PREFIX = "torch_ckpt"
LOCK_MESSAGE = "is in use by another run"


class _TestRecord:
    """What one test did, filled in by the patches and the hooks below."""

    def __init__(self) -> None:
        self.injected = 0
        self.own_io: list[str] = []
        self.saved: list[str] = []
        self.removed: set[str] = set()
        self.lock_conflict = False
        self.dirs_at_failure: list[str] = []
        self.outcome = "passed"
        self.threads_before: set[int] = set()
        self.procs_before: set[int] = set()


_current = _TestRecord()


def _own_checkpoint_io(kwargs: dict[str, Any]) -> str | None:
    """Why a Trainer built with ``kwargs`` must keep its own CheckpointIO, or None to inject ours."""
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch.strategies import Strategy

    plugins = kwargs.get("plugins")
    plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    for plugin in plugins:
        if isinstance(plugin, CheckpointIO):
            return f"plugins has a CheckpointIO ({type(plugin).__name__})"
    strategy = kwargs.get("strategy")
    if isinstance(strategy, Strategy) and getattr(strategy, "_checkpoint_io", None) is not None:
        return f"strategy has a CheckpointIO ({type(strategy._checkpoint_io).__name__})"
    return None


def _patch(owner: type, name: str, make: Any) -> Any:
    """Replace ``owner.name`` by ``make(original)``; return the function that puts the original back."""
    original = owner.__dict__[name]
    setattr(owner, name, functools.wraps(original)(make(original)))
    return lambda: setattr(owner, name, original)


def install_lightning() -> list[Any]:
    """Inject ``AsyncDCPCheckpointIO()`` into every Trainer built from now on; return the undo functions."""
    from lightning.pytorch import Trainer

    from lightning_ckpt import AsyncDCPCheckpointIO

    # the plugin installs its wrappers of Lightning when constructed: before the test modules bind `pl_load`...
    AsyncDCPCheckpointIO()

    def make(original):
        def __init__(self, *args, **kwargs):
            reason = _own_checkpoint_io(kwargs)
            if reason is None:
                plugins = kwargs.get("plugins")
                plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [
                    plugins]
                kwargs["plugins"] = [*plugins, AsyncDCPCheckpointIO()]
                _current.injected += 1
            else:
                _current.own_io.append(reason)
            original(self, *args, **kwargs)
        return __init__

    return [_patch(Trainer, "__init__", make), *install_save_recorder(AsyncDCPCheckpointIO)]


def install_accelerate() -> list[Any]:
    """Call ``accelerate_ckpt.attach`` at the end of every Accelerator built from now on; return the undo functions."""
    from accelerate import Accelerator

    import accelerate_ckpt

    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            accelerate_ckpt.attach(self)
            _current.injected += 1
        return __init__

    return [_patch(Accelerator, "__init__", make)]


def install_save_recorder(io_class: type) -> list[Any]:
    """Record the paths ``io_class.save_checkpoint`` / ``remove_checkpoint`` are given (for ``lost``)."""
    def make_save(original):
        def save_checkpoint(self, checkpoint, path, *args, **kwargs):
            result = original(self, checkpoint, path, *args, **kwargs)
            _current.saved.append(os.fspath(path))  # a save that returned: its checkpoint must appear
            return result
        return save_checkpoint

    def make_remove(original):
        def remove_checkpoint(self, path, *args, **kwargs):
            _current.removed.add(os.fspath(path))
            return original(self, path, *args, **kwargs)
        return remove_checkpoint

    return [_patch(io_class, "save_checkpoint", make_save), _patch(io_class, "remove_checkpoint", make_remove)]


def lost_paths(saved: list[str], removed: set[str]) -> list[str]:
    """Local paths in ``saved`` (not in ``removed``) whose parent folder exists while they do not."""
    lost = []
    for path in dict.fromkeys(saved):
        if path in removed or ("://" in path and not path.startswith("file://")):
            continue
        path = path.removeprefix("file://")
        if os.path.isdir(os.path.dirname(os.path.abspath(path))) and not os.path.lexists(path):
            lost.append(path)
    return lost


def ckpt_threads() -> dict[int, str]:
    """torch-ckpt's threads and writer processes alive now, by ident/pid."""
    alive = {t.ident: t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.ident}
    alive.update({p.pid: p.name for p in multiprocessing.active_children() if p.name.startswith(THREAD_PREFIX)})
    return alive


def _write(record: dict[str, Any]) -> None:
    path = os.environ.get(ENV_RECORD)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    framework = os.environ.get(ENV_INJECT, "")
    if framework and framework not in FRAMEWORKS:
        raise pytest.UsageError(f"{ENV_INJECT}={framework!r}: expected one of {FRAMEWORKS} or empty")
    undo: list[Any] = []
    if framework == "lightning":
        undo = install_lightning()
    elif framework == "accelerate":
        undo = install_accelerate()
    if framework == "" and os.environ.get(ENV_RECORD) and "lightning" in sys.modules:
        # Lightning's conftest is loaded: the plain run records its saves too, so `lost` compares like with like
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        undo += install_save_recorder(TorchCheckpointIO)
    config._peer_suites_undo = undo  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    for undo in reversed(getattr(config, "_peer_suites_undo", [])):
        undo()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _current
    _current = _TestRecord()
    alive = ckpt_threads()
    _current.threads_before = set(alive)
    _write({"nodeid": item.nodeid, "event": "start", "time": time.time()})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if call.excinfo is not None and LOCK_MESSAGE in str(call.excinfo.value):
        _current.lock_conflict = True
    if call.excinfo is not None and call.when == "call" and isinstance(call.excinfo.value, AssertionError):
        # the paths an assertion names that are directories right now (is a failed `isfile` a checkpoint dir?)
        named = re.findall(r"'(/[^']+)'", str(call.excinfo.value))
        _current.dirs_at_failure = [p for p in dict.fromkeys(named) if os.path.isdir(p)]
    if report.failed:
        _current.outcome = "failed" if report.when == "call" else "error"
    elif report.skipped and report.when != "teardown" and _current.outcome == "passed":
        _current.outcome = "skipped"
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "teardown":
        return
    # after every fixture's teardown, Lightning's thread police included
    zombies = sorted(name for ident, name in ckpt_threads().items() if ident not in _current.threads_before)
    _write({"nodeid": report.nodeid, "event": "done", "outcome": _current.outcome,
            "injected": _current.injected, "own_io": _current.own_io, "zombies": zombies,
            "lost": lost_paths(_current.saved, _current.removed), "lock_conflict": _current.lock_conflict,
            "dirs_at_failure": _current.dirs_at_failure})
