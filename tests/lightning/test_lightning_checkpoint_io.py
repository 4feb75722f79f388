"""lightning_ckpt._checkpoint_io: AsyncDCPCheckpointIO saves, removes, overwrites, loads and tears down."""

from __future__ import annotations

import os
from fractions import Fraction

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_helpers import lightning_dict

from lightning_ckpt import AsyncDCPCheckpointIO
from torch_ckpt import CheckpointWriteError, ConfigError, UnsafeCheckpointError


def test_save_then_load_returns_the_lightning_dict(tmp_path):
    """A saved checkpoint loads back with equal tensors and the same Python types (int keys, tuples)."""
    io = AsyncDCPCheckpointIO()
    io.save_checkpoint(lightning_dict(3), tmp_path / "a.ckpt")
    io.wait()
    loaded = io.load_checkpoint(tmp_path / "a.ckpt")
    assert torch.equal(loaded["state_dict"]["layer.weight"], torch.full((2, 3), 3.0))
    assert loaded["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert torch.equal(loaded["optimizer_states"][0]["state"][0]["momentum_buffer"], torch.ones(2, 3))
    assert loaded["loops"] == lightning_dict()["loops"] and loaded["global_step"] == 3
    io.teardown()


def test_save_returns_before_the_write_is_committed(tmp_path, write_gate):
    """While the background write is held, save_checkpoint has returned and the path is reserved, not committed."""
    io = AsyncDCPCheckpointIO()
    write_gate.hold()
    io.save_checkpoint(lightning_dict(), tmp_path / "a.ckpt")
    assert io.saving and (tmp_path / "a.ckpt").is_dir() and not io.is_checkpoint_dir(tmp_path / "a.ckpt")
    write_gate.release()
    io.wait()
    assert io.is_checkpoint_dir(tmp_path / "a.ckpt") and not io.saving
    io.teardown()


def test_removing_the_in_flight_checkpoint_deletes_it_after_its_commit(tmp_path, write_gate):
    """Top-k removal of a checkpoint still being written returns at once and leaves no partial files."""
    io = AsyncDCPCheckpointIO()
    write_gate.hold()
    io.save_checkpoint(lightning_dict(), tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    write_gate.release()
    io.wait()
    assert visible(tmp_path) == []
    io.teardown()


def test_an_older_checkpoint_is_removed_only_once_the_newer_one_is_committed(tmp_path, write_gate):
    """Removing the previous checkpoint while the next one is in flight keeps it until the commit."""
    io = AsyncDCPCheckpointIO()
    io.save_checkpoint(lightning_dict(1), tmp_path / "a.ckpt")
    io.wait()
    write_gate.hold()
    io.save_checkpoint(lightning_dict(2), tmp_path / "b.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert io.is_checkpoint_dir(tmp_path / "a.ckpt")
    write_gate.release()
    io.wait()
    assert sorted(visible(tmp_path)) == ["b.ckpt"]
    io.teardown()


def test_a_failed_save_keeps_the_checkpoint_it_was_to_replace(tmp_path, write_gate):
    """If the newer save fails, the removal queued behind it is dropped and the older checkpoint stays."""
    io = AsyncDCPCheckpointIO()
    io.save_checkpoint(lightning_dict(1), tmp_path / "a.ckpt")
    io.wait()
    write_gate.hold()
    write_gate.fail_with = CheckpointWriteError("disk full (injected)")
    io.save_checkpoint(lightning_dict(2), tmp_path / "b.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    write_gate.release()
    with pytest.raises(CheckpointWriteError, match="injected"):
        io.wait()
    assert sorted(visible(tmp_path)) == ["a.ckpt"]
    io.teardown()


def test_overwriting_swaps_the_new_checkpoint_in_only_when_committed(tmp_path, write_gate):
    """Saving to an existing path (save_last=True) keeps the old checkpoint committed until the new one commits;
    the plugin's own load of that path waits for the commit (as with a synchronous save)."""
    from torch_ckpt import load_full_state
    io = AsyncDCPCheckpointIO()
    io.save_checkpoint(lightning_dict(1), tmp_path / "last.ckpt")
    io.wait()
    write_gate.hold()
    io.save_checkpoint(lightning_dict(2), tmp_path / "last.ckpt")
    assert io.is_checkpoint_dir(tmp_path / "last.ckpt")
    assert load_full_state(tmp_path / "last.ckpt")[0]["global_step"] == 1  # the old one, intact on disk
    write_gate.release()
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 2
    assert visible(tmp_path) == ["last.ckpt"]
    io.teardown()


def visible(directory) -> list[str]:
    """Entries of ``directory`` without hidden ones (the manager's root lock, temporaries)."""
    return sorted(p for p in os.listdir(directory) if not p.startswith("."))




def test_loads_a_plain_ckpt_file(tmp_path):
    """A checkpoint file written by Lightning's TorchCheckpointIO still loads (switching mid-project)."""
    TorchCheckpointIO().save_checkpoint(lightning_dict(5), tmp_path / "old.ckpt")
    loaded = AsyncDCPCheckpointIO().load_checkpoint(tmp_path / "old.ckpt", weights_only=True)
    assert loaded["global_step"] == 5 and torch.equal(loaded["state_dict"]["layer.bias"], torch.zeros(2))


def test_a_value_that_needs_pickling_is_refused_naming_its_key(tmp_path):
    """With unsafe_values='error', a Fraction hyper-parameter raises ConfigError naming the key; nothing is written."""
    io = AsyncDCPCheckpointIO(unsafe_values="error")
    with pytest.raises(ConfigError, match=r"hyper_parameters\.data_dir"):
        io.save_checkpoint(lightning_dict(hyper_parameters={"data_dir": Fraction(1, 3)}), tmp_path / "a")
    assert visible(tmp_path) == []
    io.teardown()


def test_pickled_values_load_only_with_weights_only_false(tmp_path):
    """With unsafe_values='pickle', loading needs weights_only=False; otherwise it names the key."""
    io = AsyncDCPCheckpointIO(unsafe_values="pickle")
    io.save_checkpoint(lightning_dict(hyper_parameters={"data_dir": Fraction(1, 3)}), tmp_path / "a")
    io.wait()
    with pytest.raises(UnsafeCheckpointError, match=r"hyper_parameters\.data_dir"):
        io.load_checkpoint(tmp_path / "a")
    assert io.load_checkpoint(tmp_path / "a", weights_only=False)["hyper_parameters"]["data_dir"] == Fraction(1, 3)
    io.teardown()


def test_teardown_raises_a_background_write_error_once(tmp_path, write_gate):
    """A failed background write surfaces at teardown, and only once."""
    io = AsyncDCPCheckpointIO()
    write_gate.fail_with = CheckpointWriteError("disk full (injected)")
    io.save_checkpoint(lightning_dict(), tmp_path / "a.ckpt")
    with pytest.raises(CheckpointWriteError, match="injected"):
        io.teardown()
    io.teardown()


def test_storage_options_are_rejected(tmp_path):
    """storage_options raise TypeError, like Lightning's TorchCheckpointIO for unsupported options."""
    with pytest.raises(TypeError, match="storage_options"):
        AsyncDCPCheckpointIO().save_checkpoint(lightning_dict(), tmp_path / "a", storage_options={"x": 1})



def test_the_plugin_pickles_without_its_runtime_state(tmp_path):
    """After a save (writer thread, locks) the plugin still pickles, as ddp_spawn needs, and the copy saves."""
    import pickle

    io = AsyncDCPCheckpointIO(unsafe_values="pickle")
    io.save_checkpoint(lightning_dict(), tmp_path / "a.ckpt")
    clone = pickle.loads(pickle.dumps(io))
    io.teardown()
    clone.save_checkpoint(lightning_dict(2), tmp_path / "b.ckpt")
    clone.teardown()
    assert clone.unsafe_values == "pickle" and AsyncDCPCheckpointIO.is_checkpoint_dir(tmp_path / "b.ckpt")


def test_a_save_after_fit_returns_once_committed(make_trainer, tmp_path):
    """trainer.save_checkpoint by hand after fit returns with the directory committed (wait_outside_fit)."""
    from lightning_helpers import TinyModule

    trainer = make_trainer(max_steps=1, plugins=[AsyncDCPCheckpointIO()], enable_checkpointing=False)
    trainer.fit(TinyModule())
    trainer.save_checkpoint(tmp_path / "manual.ckpt")
    assert AsyncDCPCheckpointIO.is_checkpoint_dir(tmp_path / "manual.ckpt")


def test_the_plugin_alone_warns_that_a_resume_does_not_restore_the_rng(make_trainer, tmp_path):
    """Resuming with the plugin but without MTBFCheckpoint warns that the RNG is not restored."""
    from lightning_helpers import TinyModule

    io = AsyncDCPCheckpointIO()
    trainer = make_trainer(max_steps=1, plugins=[io], enable_checkpointing=False)
    trainer.fit(TinyModule())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    io.attach(trainer2 := make_trainer(max_steps=2, plugins=[io], enable_checkpointing=False))
    with pytest.warns(UserWarning, match="does not restore the RNG"):
        trainer2.fit(TinyModule(), ckpt_path=tmp_path / "a.ckpt")


@pytest.mark.parametrize("incremental", [True, False])
def test_incremental_links_unchanged_tensors_unless_turned_off(tmp_path, incremental):
    """A second save of the same values hard-links the first one's data files; incremental=False writes them."""
    import json

    io = AsyncDCPCheckpointIO(incremental=incremental)
    for name in ("a.ckpt", "b.ckpt"):
        io.save_checkpoint(lightning_dict(3), tmp_path / name)
        io.wait()
    files = json.loads((tmp_path / "b.ckpt" / "manifest.json").read_text())["files"]
    assert any("linked_from" in info for info in files.values()) == incremental
    assert torch.equal(io.load_checkpoint(tmp_path / "b.ckpt")["state_dict"]["layer.weight"], torch.full((2, 3), 3.0))
    io.teardown()
