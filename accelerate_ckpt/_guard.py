"""Spot a ``save_state()`` call that only some processes make, from the calling source, before any collective.

``if accelerator.is_main_process: accelerator.save_state(dir)`` works in plain Accelerate; with
torch-ckpt every process writes its shard, so the main process alone would wait ``timeout_seconds``.
The usual guards (``is_main_process``, ``process_index == 0``, ``@on_main_process``...) are found at once.
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
import sys

__all__ = ["one_process_guard"]

_ONE_PROCESS_FLAGS = frozenset({"is_main_process", "is_local_main_process", "is_last_process"})
_ONE_PROCESS_INDEX = frozenset({"process_index", "local_process_index"})
_ONE_PROCESS_DECORATORS = frozenset({"on_main_process", "on_local_main_process", "on_last_process", "on_process",
                                     "on_local_process"})
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=64)
def _module_tree(filename: str) -> ast.Module | None:
    try:
        return ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return None


def _limits_to_some_processes(test: ast.expr) -> bool:
    """True for ``acc.is_main_process``, ``acc.process_index == 0`` and ``and`` chains holding one."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_limits_to_some_processes(v) for v in test.values)
    if isinstance(test, ast.Compare):
        test = test.left
    return isinstance(test, ast.Attribute) and test.attr in _ONE_PROCESS_FLAGS | _ONE_PROCESS_INDEX


def one_process_guard() -> str | None:
    """The ``if``/decorator of the user code calling ``save_state`` (the first frame outside this package)
    that runs it on some processes only, or None."""
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PACKAGE_DIR:
        frame = frame.f_back
    tree = None if frame is None else _module_tree(frame.f_code.co_filename)
    if tree is None:
        return None
    line, node, guard = frame.f_lineno, tree, None
    while node is not None:
        inner = None
        for child in ast.iter_child_nodes(node):
            if getattr(child, "lineno", line + 1) <= line <= (getattr(child, "end_lineno", None) or -1):
                inner = child
                break
        if isinstance(inner, ast.If) and _limits_to_some_processes(inner.test) and any(
                b.lineno <= line <= b.end_lineno for b in inner.body):
            guard = f"if {ast.unparse(inner.test)}:"
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
            guard = None  # a guard outside the function does not guard its body...
            for deco in inner.decorator_list:  # ...but a decorator on it does
                target = deco.func if isinstance(deco, ast.Call) else deco
                if isinstance(target, ast.Attribute) and target.attr in _ONE_PROCESS_DECORATORS:
                    guard = f"@{ast.unparse(deco)}"
        node = inner
    return guard
