"""``one_process_guard``: the guards that make only some processes call ``save_state``, read from the source."""

from __future__ import annotations

from types import SimpleNamespace

from accelerate_ckpt._guard import one_process_guard

acc = SimpleNamespace(is_main_process=True, process_index=0, on_main_process=lambda fn: fn)


def test_if_is_main_process_is_found():
    """A call inside ``if acc.is_main_process:`` reports that guard."""
    if acc.is_main_process:
        assert one_process_guard() == "if acc.is_main_process:"


def test_process_index_comparison_inside_an_and_is_found():
    """``if ready and acc.process_index == 0:`` is a guard too."""
    ready = True
    if ready and acc.process_index == 0:
        assert one_process_guard() == "if ready and acc.process_index == 0:"


def test_on_main_process_decorator_is_found():
    """A call in a function decorated with ``@acc.on_main_process`` reports the decorator."""

    @acc.on_main_process
    def save():
        return one_process_guard()

    assert save() == "@acc.on_main_process"


def test_unguarded_call_and_else_branch_are_not_guards():
    """A plain call, and one in the ``else`` of a main-process test, report nothing."""
    assert one_process_guard() is None
    if not acc.is_main_process:
        pass
    else:
        assert one_process_guard() is None
