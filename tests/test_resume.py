"""torch_ckpt.restore._resume: which checkpoints a resume may start from, local and durable, newest first.

The durable tier is a fake object (``list_steps`` and ``url``), so no store is involved; local
checkpoints are directories holding only a manifest, which is all ``scan_committed`` reads.
"""

from __future__ import annotations

import pytest

from torch_ckpt.errors import CheckpointCorruptError, CheckpointNotFoundError
from torch_ckpt.policy._naming import PatternNaming, StepNaming
from torch_ckpt.restore._resume import resume_plan
from torch_ckpt.root._layout import MANIFEST_NAME, Manifest, write_json_durable
from torch_ckpt.storage._locations import DurableUnavailableError

URL = "s3://bucket/run"


class FakeTier:
    """Stands in for DurableTier: lists the given steps, or raises an outage."""

    def __init__(self, steps=(), *, outage: bool = False) -> None:
        self.url = URL
        self.steps = list(steps)
        self.outage = outage

    def list_steps(self):
        if self.outage:
            raise DurableUnavailableError(f"cannot list durable tier {self.url}: connection refused")
        return {s: Manifest(step=s, world_size=1, files={}) for s in self.steps}

    def listed(self):
        return self.list_steps()


def restore_candidates(root, tier, step, naming=None):
    """The plan's candidates, or the exception the coordinator would broadcast."""
    plan = resume_plan(root, tier, step, naming)
    return plan if isinstance(plan, BaseException) else plan.candidates


def commit_local(root, step, *, manifest_step=None, naming=None):
    """Create a committed-looking local checkpoint of ``step`` (its manifest may claim another step)."""
    d = root / (naming or StepNaming()).name(step)
    d.mkdir(parents=True)
    write_json_durable(d / MANIFEST_NAME, Manifest(step=step if manifest_step is None else manifest_step,
                                                   world_size=1, files={}).to_json())
    return d


def test_local_only_lists_local_steps_newest_first(tmp_path):
    """Without a durable tier, every committed local step is a candidate, newest first."""
    for s in (3, 10, 7):
        commit_local(tmp_path, s)
    assert restore_candidates(tmp_path, None, None) == [(10, "local"), (7, "local"), (3, "local")]


def test_durable_only_lists_durable_steps_newest_first(tmp_path):
    """With an empty local root, the durable tier's steps are the candidates, newest first."""
    assert restore_candidates(tmp_path, FakeTier([5, 20]), None) == [(20, "durable"), (5, "durable")]


def test_both_tiers_merge_and_prefer_the_local_copy(tmp_path):
    """Steps of both tiers are merged; a step held by both is read from the local copy, then the durable one."""
    commit_local(tmp_path, 10)
    commit_local(tmp_path, 30)
    assert restore_candidates(tmp_path, FakeTier([10, 20]), None) == [(30, "local"), (20, "durable"),
                                                                      (10, "local"), (10, "durable")]


def test_nothing_anywhere_gives_an_empty_list(tmp_path):
    """A missing root and no tier is a fresh start: no candidates and no error."""
    assert restore_candidates(tmp_path / "absent", None, None) == []


def test_explicit_local_step_is_the_only_candidate(tmp_path):
    """An explicit step committed locally is the only step planned (its local copy, then its durable one)."""
    commit_local(tmp_path, 4)
    commit_local(tmp_path, 8)
    assert restore_candidates(tmp_path, FakeTier([4, 12]), 4) == [(4, "local"), (4, "durable")]


def test_explicit_durable_step_is_read_from_the_durable_tier(tmp_path):
    """An explicit step held only by the durable tier is read from there."""
    commit_local(tmp_path, 8)
    assert restore_candidates(tmp_path, FakeTier([6]), 6) == [(6, "durable")]


def test_explicit_absent_step_is_returned_as_not_found_naming_both_tiers(tmp_path):
    """An explicit step nowhere committed is returned (not raised) as CheckpointNotFoundError naming root and URL."""
    commit_local(tmp_path, 8)
    result = restore_candidates(tmp_path, FakeTier([6]), 5)
    assert isinstance(result, CheckpointNotFoundError)
    assert str(tmp_path) in str(result) and URL in str(result) and "[6, 8]" in str(result)


def test_explicit_step_whose_manifest_names_another_step_is_corrupt(tmp_path):
    """A directory named for the step whose manifest claims another step is returned as CheckpointCorruptError."""
    commit_local(tmp_path, 9, manifest_step=99)
    result = restore_candidates(tmp_path, None, 9)
    assert isinstance(result, CheckpointCorruptError)
    assert "step 99, not 9" in str(result)


def test_explicit_step_directory_without_manifest_is_not_found(tmp_path):
    """A directory named for the step but without a manifest (an uncommitted copy) is CheckpointNotFoundError."""
    (tmp_path / StepNaming().name(9)).mkdir()
    result = restore_candidates(tmp_path, None, 9)
    assert isinstance(result, CheckpointNotFoundError)
    assert MANIFEST_NAME in str(result)


def test_durable_outage_without_local_copy_refuses_to_start_from_scratch(tmp_path):
    """An outage with no local checkpoint is returned as DurableUnavailableError telling what to do."""
    result = restore_candidates(tmp_path, FakeTier(outage=True), None)
    assert isinstance(result, DurableUnavailableError)
    assert "refusing to start from scratch" in str(result) and "durable_url" in str(result)


def test_durable_outage_with_local_copy_resumes_from_local(tmp_path):
    """An outage with a local checkpoint falls back to the local tier's steps."""
    commit_local(tmp_path, 2)
    assert restore_candidates(tmp_path, FakeTier([50], outage=True), None) == [(2, "local")]


def test_durable_outage_with_local_copy_and_explicit_durable_step_is_unavailable(tmp_path):
    """During an outage an explicit step absent locally is reported unavailable (naming the outage), not absent."""
    commit_local(tmp_path, 2)
    result = restore_candidates(tmp_path, FakeTier([50], outage=True), 50)
    assert isinstance(result, DurableUnavailableError) and "step 50" in str(result)
    assert "connection refused" in str(result)


def test_custom_naming_is_used_for_listing_and_explicit_steps(tmp_path):
    """Only directories of the given naming are listed, and an explicit step is looked up by that naming."""
    naming = PatternNaming("checkpoint_{step}")
    commit_local(tmp_path, 3, naming=naming)
    commit_local(tmp_path, 4)  # step_000000004: another naming, not listed
    assert restore_candidates(tmp_path, None, None, naming) == [(3, "local")]
    assert isinstance(restore_candidates(tmp_path, None, 4, naming), CheckpointNotFoundError)


@pytest.mark.parametrize("manifest_text", ["{not json", '{"format": "other"}'])
def test_explicit_step_with_an_unreadable_manifest_is_returned_as_corrupt(tmp_path, manifest_text):
    """A damaged manifest at the explicit step is returned as CheckpointCorruptError, never raised."""
    d = tmp_path / StepNaming().name(1)
    d.mkdir()
    (d / MANIFEST_NAME).write_text(manifest_text)
    assert isinstance(restore_candidates(tmp_path, None, 1), CheckpointCorruptError)
