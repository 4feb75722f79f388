"""The staging budget inside memory cgroups (v1 and v2) and when the staging arena cannot be allocated."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from torch_ckpt import CheckpointManager
from torch_ckpt.save import _checkpointer as memory_limits
from torch_ckpt.save import _checkpointer as staging
from torch_ckpt.save._checkpointer import HostStager, StagingMemoryError, cgroup_memory_headroom, default_budget_bytes

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]


def _write(d: Path, **files: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("__", ".")).write_text(text)


def test_v2_limit_minus_working_set_is_the_headroom(tmp_path):
    """cgroup v2: memory.max less memory.current plus inactive file pages."""
    _write(tmp_path, cgroup__controllers="cpu memory")
    _write(tmp_path / "job", memory__max=str(900 * MiB), memory__current=str(500 * MiB),
           memory__stat=f"anon 1\ninactive_file {100 * MiB}\n")
    assert cgroup_memory_headroom(tmp_path, "0::/job\n") == 500 * MiB


def test_v2_nested_parent_limit_applies(tmp_path):
    """A parent's memory.max caps a child whose own limit is "max"."""
    _write(tmp_path, cgroup__controllers="memory")
    _write(tmp_path / "a", memory__max=str(1000 * MiB), memory__current=str(900 * MiB))
    _write(tmp_path / "a" / "b", memory__max="max", memory__current=str(10 * MiB))
    assert cgroup_memory_headroom(tmp_path, "0::/a/b\n") == 100 * MiB


def test_v2_memory_high_counts_as_a_limit(tmp_path):
    """memory.high below memory.max is the limit (above it the kernel throttles)."""
    _write(tmp_path, cgroup__controllers="memory")
    _write(tmp_path / "j", memory__max="max", memory__high=str(300 * MiB), memory__current=str(100 * MiB))
    assert cgroup_memory_headroom(tmp_path, "0::/j\n") == 200 * MiB


def test_v2_unlimited_is_none(tmp_path):
    """No limit anywhere on the path: None (the host figure applies)."""
    _write(tmp_path, cgroup__controllers="memory")
    _write(tmp_path / "j", memory__max="max", memory__current="5")
    assert cgroup_memory_headroom(tmp_path, "0::/j\n") is None


def test_v1_limit_and_usage_with_hybrid_unified_mount(tmp_path):
    """cgroup v1 memory controller (hybrid mount: v2 at unified/ without memory files)."""
    _write(tmp_path / "unified", cgroup__controllers="")
    _write(tmp_path / "memory" / "docker" / "c1", memory__limit_in_bytes=str(900 * MiB),
           memory__usage_in_bytes=str(700 * MiB), memory__stat=f"total_inactive_file {50 * MiB}\n")
    text = "4:memory:/docker/c1\n0::/docker/c1\n"
    assert cgroup_memory_headroom(tmp_path, text) == 250 * MiB


def test_v1_unlimited_sentinel_is_none(tmp_path):
    """v1 writes about 2**63 for "no limit": None."""
    _write(tmp_path / "memory" / "x", memory__limit_in_bytes="9223372036854771712", memory__usage_in_bytes="1")
    _write(tmp_path / "memory", memory__limit_in_bytes="9223372036854771712", memory__usage_in_bytes="1")
    assert cgroup_memory_headroom(tmp_path, "3:memory,cpu:/x\n") is None


def test_container_root_mount_without_cgroup_namespace(tmp_path):
    """The path in /proc/self/cgroup is absent under the mount: the mount root's limit is read."""
    _write(tmp_path / "memory", memory__limit_in_bytes=str(900 * MiB), memory__usage_in_bytes=str(100 * MiB))
    assert cgroup_memory_headroom(tmp_path, "4:memory:/kubepods/pod1/abc\n") == 800 * MiB


def test_usage_above_limit_is_zero_headroom(tmp_path):
    """A cgroup already at (or over) its limit leaves 0 bytes, never a negative budget."""
    _write(tmp_path, cgroup__controllers="memory", memory__max=str(100), memory__current=str(200))
    assert cgroup_memory_headroom(tmp_path, "0::/\n") == 0


def test_default_budget_honours_the_cgroup(tmp_path, monkeypatch):
    """default_budget_bytes() is half of the cgroup headroom when that is below the host's free RAM."""
    _write(tmp_path, cgroup__controllers="memory")
    _write(tmp_path / "j", memory__max=str(900 * MiB), memory__current=str(500 * MiB))
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/j\n")
    monkeypatch.setattr(memory_limits, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(memory_limits, "PROC_SELF_CGROUP", proc)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_budget_bytes() == 200 * MiB
    assert default_budget_bytes(2) == 100 * MiB
    assert HostStager().budget_bytes == 200 * MiB


def _refusing_arenas(real):
    """``torch.empty`` that fails like an exhausted allocator for staging arenas (flat uint8 buffers)."""
    def empty(*args, **kwargs):
        if kwargs.get("dtype") is torch.uint8 and "pin_memory" in kwargs:  # the arena call of HostStager
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4000 bytes")
        return real(*args, **kwargs)

    return empty


def test_failed_arena_allocation_is_a_typed_error_naming_the_budget(monkeypatch):
    """An arena allocation that fails raises StagingMemoryError naming the bytes, budget and setting."""
    stager = HostStager(budget_bytes=1 << 30)
    monkeypatch.setattr(staging.torch, "empty", _refusing_arenas(torch.empty))
    with pytest.raises(StagingMemoryError, match="staging_budget_bytes") as info:
        stager.reserve({"w": torch.zeros(10)})
    assert info.value.errno == 12 and "1073741824" in str(info.value) and stager.arena is None


@pytest.mark.parametrize("persist", ["thread", "process"])
def test_failed_arena_allocation_falls_back_to_a_synchronous_save(tmp_path, monkeypatch, persist):
    """A save whose arena cannot be allocated commits synchronously from the live tensors."""
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    with CheckpointManager(tmp_path, persist=persist) as mgr:
        monkeypatch.setattr(staging.torch, "empty", _refusing_arenas(torch.empty))
        handle = mgr.save(1, state)
        mgr.wait()
        monkeypatch.undo()  # (torch.empty itself was replaced)
        assert handle.stats.mode == "sync-over-budget" and mgr.all_steps() == [1]
        out = {"w": torch.zeros(1000)}
        mgr.restore(out)
    assert torch.equal(out["w"], state["w"])


def test_a_save_into_the_arena_it_already_has_asks_no_budget(tmp_path, monkeypatch):
    """Once the arena fits the state, later saves stage into it whatever memory is left; a new layout asks again."""
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.save(1, state).stats.mode == "async"
        mgr.wait()
        asked: list[int] = []

        def starved(local_world_size=None, *, held_bytes=0):
            asked.append(held_bytes)
            return 1  # nothing left to allocate

        monkeypatch.setattr(staging, "default_budget_bytes", starved)
        state["w"].add_(1.0)
        assert mgr.save(2, state).stats.mode == "async" and asked == []  # the arena is there: nothing allocated
        mgr.wait()
        state["v"] = torch.ones(10)  # another layout: a new arena, which the budget refuses
        assert mgr.save(3, state).stats.mode == "sync-over-budget" and asked
        mgr.wait()
        out = {"w": torch.zeros(1000), "v": torch.zeros(10)}
        mgr.restore(out)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["v"], state["v"])


_TRAINER = textwrap.dedent("""
    import sys, torch
    from torch_ckpt import CheckpointManager
    state = {"w": torch.ones(int(sys.argv[2]) // 4)}
    if len(sys.argv) > 3:  # address space limited to what is mapped now plus this many bytes (ulimit -v)
        import resource
        mapped = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (mapped + int(sys.argv[3]),) * 2)
    with CheckpointManager(sys.argv[1]) as mgr:
        handle = mgr.save(1, state)
        mgr.wait()
        print("MODE", handle.stats.mode, "STEPS", mgr.all_steps(), flush=True)
""")


def _run_trainer(root: Path, nbytes: int, *extra: str, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("LOCAL_WORLD_SIZE", None)
    return subprocess.run([*(prefix or []), sys.executable, "-c", _TRAINER, str(root), str(nbytes), *extra],
                          env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_address_space_limit_falls_back_to_a_synchronous_save(tmp_path):
    """Under ulimit -v (RLIMIT_AS) a 400 MB state's save commits synchronously instead of failing."""
    result = _run_trainer(tmp_path / "ck", 400_000_000, str(300 * MiB))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MODE sync-over-budget STEPS [1]" in result.stdout, result.stdout + result.stderr[-3000:]


def _memory_cgroup(limit: int) -> tuple[Path, Path]:
    """A fresh memory cgroup limited to ``limit`` bytes: ``(its directory, its procs file)``; skips where impossible."""
    name = f"torch_ckpt_test_{uuid.uuid4().hex[:8]}"
    v1 = memory_limits.CGROUP_ROOT / "memory"
    unified = memory_limits.CGROUP_ROOT
    if (unified / "cgroup.controllers").is_file() and "memory" in (unified / "cgroup.controllers").read_text():
        d = unified / name
        limit_file = "memory.max"
    elif (v1 / "memory.limit_in_bytes").is_file():
        d = v1 / name
        limit_file = "memory.limit_in_bytes"
    else:
        pytest.skip("no memory cgroup controller mounted under /sys/fs/cgroup")
    try:
        d.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup here: {exc}")
    try:
        (d / limit_file).write_text(str(limit))
    except OSError as exc:
        d.rmdir()
        pytest.skip(f"cannot set a memory cgroup limit here: {exc}")
    return d, d / "cgroup.procs"


@pytest.mark.slow
def test_default_settings_commit_in_a_900_mib_cgroup(tmp_path):
    """A trainer with a 400 MB state in a 900 MiB memory cgroup commits its first save with no setting."""
    d, procs = _memory_cgroup(900 * MiB)
    try:
        result = _run_trainer(tmp_path / "ck", 400_000_000,
                              prefix=["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh"])
    finally:
        if (d / "memory.force_empty").exists():
            try:
                (d / "memory.force_empty").write_text("0")
            except OSError:
                pass
        d.rmdir()
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-3000:]}"
    assert "STEPS [1]" in result.stdout, result.stdout
