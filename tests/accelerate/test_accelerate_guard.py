"""``missing_processes``: a ``save_state()`` that only some processes make is found by a short presence wait."""

from __future__ import annotations

import threading
import time

from accelerate_ckpt._checkpointer import missing_processes


def test_a_process_that_never_saves_is_reported_after_the_timeout(tmp_path):
    """Rank 0 alone (as under ``if accelerator.is_main_process:``): rank 1 is missing, after about the timeout."""
    t0 = time.monotonic()
    assert missing_processes(tmp_path, "3", 0, range(2), timeout_s=0.3) == [1]
    assert 0.3 <= time.monotonic() - t0 < 5


def test_every_process_saving_passes_and_rank_0_clears_older_marks(tmp_path):
    """Both ranks (threads here) calling it pass; rank 0 then removes the marks of earlier saves, not this one's."""
    assert missing_processes(tmp_path, "0", 1, range(2), timeout_s=0.0) == [0]  # an earlier save's mark of rank 1
    found = {}
    threads = [threading.Thread(target=lambda r=r: found.setdefault(r, missing_processes(tmp_path, "1", r, range(2),
                                                                                         5.0))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert found == {0: [], 1: []}
    assert [p.name for p in tmp_path.iterdir()] == [".accelerate_ckpt.present.1"]


def test_a_retry_after_a_refused_save_passes(tmp_path):
    """The refused call's mark stays: when every process then calls save_state, the same save passes."""
    assert missing_processes(tmp_path, "0", 0, range(2), timeout_s=0.0) == [1]
    assert missing_processes(tmp_path, "0", 1, range(2), timeout_s=1.0) == []
    assert missing_processes(tmp_path, "0", 0, range(2), timeout_s=1.0) == []


def test_only_the_ranks_of_this_node_are_awaited(tmp_path):
    """Ranks 2 and 3 (the second node of 2x2) wait for each other only: rank 0's and 1's marks are not needed."""
    assert missing_processes(tmp_path, "0", 2, range(2, 4), timeout_s=0.0) == [3]
    assert missing_processes(tmp_path, "0", 3, range(2, 4), timeout_s=0.0) == []
