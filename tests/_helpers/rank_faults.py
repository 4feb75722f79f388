"""One rank of a multi-rank fault scenario (tests/test_rank_faults.py): ``python rank_faults.py SCENARIO ROOT PERSIST``.

Started as a plain process per rank (not a daemon), so ``persist="process"`` can start its writer
process. Rank, world size and rendezvous come from the environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``). Prints one ``RESULT <json>`` line.

The fault hooks are installed at import, so they also act in the writer process (spawn re-imports
this module as ``__mp_main__``), where the shard writes of ``persist="process"`` happen.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

SLOW_S = float(os.environ.get("FAULT_SLOW_S", "5"))
SLOW_STEP = 3


def _install_hooks() -> None:
    """Rank 1 is ``SLOW_S`` seconds slow inside its shard write of step ``SLOW_STEP`` (FAULT=slow_shard)."""
    if os.environ.get("FAULT") != "slow_shard" or os.environ.get("RANK") != "1":
        return
    import torch_ckpt.save._persist as persist_mod

    real = persist_mod.write_json_durable

    def slow(path, obj):
        if Path(path).name.startswith("rank_") and obj.get("step") == SLOW_STEP:
            time.sleep(SLOW_S)
        return real(path, obj)

    persist_mod.write_json_durable = slow


_install_hooks()


def slow_shard(root: str, persist: str, timeout_s: float) -> dict:
    import torch
    import torch.distributed as dist

    from torch_ckpt import CheckpointError, CheckpointManager

    model = torch.nn.Linear(16, 16)
    outcome = {}
    if os.environ.get("FAULT_NODE_LOCAL"):  # node-local roots: each rank (its own node) has its own directory
        root = os.path.join(root, f"node{os.environ['RANK']}")
    dist.barrier()  # every rank is up: the short timeout then only measures the fault
    with CheckpointManager(root, timeout_seconds=timeout_s, persist=persist, keep_last=10) as mgr:
        for step in range(1, 8):
            t0 = time.monotonic()
            try:
                mgr.save(step, {"model": model.state_dict(), "step": step})
                mgr.wait()
                outcome[step] = ["ok", round(time.monotonic() - t0, 3)]
            except CheckpointError as exc:
                outcome[step] = [type(exc).__name__, round(time.monotonic() - t0, 3), str(exc)[:300]]
            dist.barrier()  # the training step between saves (a DDP all-reduce) keeps the ranks in step
        steps = mgr.all_steps()
        mgr.wait()
        return {"outcome": outcome, "steps": steps, "generation": mgr._ctx.generation,
                "listing": sorted(p.name for p in Path(root).iterdir())}


def _storage_options(durable: str | None) -> dict | None:
    """The S3 client options of the test's moto server (FAULT_S3_OPTIONS, JSON) for an s3:// URL."""
    if durable is None or not durable.startswith("s3://"):
        return None
    return json.loads(os.environ["FAULT_S3_OPTIONS"])


def _saved_once(local: str, durable: str | None, timeout_s: float) -> dict:
    """Every rank saves step 1 (and waits for its durable copy); returns the state."""
    import torch
    import torch.distributed as dist

    from torch_ckpt import CheckpointManager

    torch.manual_seed(0)
    state = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    dist.barrier()
    with CheckpointManager(local, timeout_seconds=timeout_s, durable_url=durable,
                               storage_options=_storage_options(durable)) as mgr:
        mgr.save(1, state)
        mgr.wait()
        if durable is not None:
            assert mgr.wait_durable(60)
    dist.barrier()
    return state


def _timed_restore(local: str, durable: str | None, timeout_s: float) -> dict:
    import torch

    from torch_ckpt import CheckpointError, CheckpointManager

    out = {"w": torch.zeros(64, 64), "b": torch.zeros(64)}
    t0 = time.monotonic()
    try:
        with CheckpointManager(local, timeout_seconds=timeout_s, durable_url=durable,
                               storage_options=_storage_options(durable)) as mgr:
            step = mgr.restore(out)
        return {"kind": "ok", "step": step, "elapsed": time.monotonic() - t0}
    except CheckpointError as exc:
        return {"kind": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc),
                "elapsed": time.monotonic() - t0}
    except OSError as exc:
        return {"kind": "bare " + type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - t0}


def efbig_download(root: str, persist: str, timeout_s: float) -> dict:
    """Rank 0 downloads the durable copy into an empty local root with a 1 KiB file-size limit (EFBIG)."""
    import resource
    import shutil
    import signal

    import torch.distributed as dist

    local = os.path.join(root, "local")
    durable = os.environ.get("FAULT_DURABLE_URL") or "file://" + os.path.join(root, "durable")
    _saved_once(local, durable, timeout_s)
    if int(os.environ["RANK"]) == 0:
        shutil.rmtree(os.path.join(local, "step_000000001"))  # a fresh node: only the durable copy is left
    dist.barrier()
    if int(os.environ["RANK"]) == 0:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # then the write fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return _timed_restore(local, durable, timeout_s)


def eio_restore(root: str, persist: str, timeout_s: float) -> dict:
    """Rank 1 gets an I/O error reading its part of a committed checkpoint."""
    import torch_ckpt.restore._restore as restore_mod

    local = os.path.join(root, "local")
    _saved_once(local, None, timeout_s)
    if int(os.environ["RANK"]) == 1:
        real = restore_mod.verify_files

        def failing(step_dir, *args, **kwargs):
            raise OSError(5, "Input/output error", str(Path(step_dir) / "__1_0.distcp"))

        restore_mod.verify_files = failing
        del real
    return _timed_restore(local, None, timeout_s)


def killed_after_rename(root: str, persist: str, timeout_s: float) -> dict:
    """Rank 1 dies after rank 0's rename of step 3 (inside the commit broadcast); the job is then restarted.

    Phase "run" (FAULT_PHASE=run): steps 1-2 commit and replicate; at step 3 rank 1 exits in the
    commit broadcast. Rank 0 reports its outcome and the listing, then exits as a launcher would
    end it, before the replication or retention of step 3 can run. Phase "restart": a new
    manager on every rank.
    """
    import torch
    import torch.distributed as dist

    import torch_ckpt.manager._manager as commit_mod
    from torch_ckpt import CheckpointError, CheckpointManager
    from torch_ckpt.distributed._context import DistContext
    from torch_ckpt.root._layout import read_manifest

    local, durable = os.path.join(root, "local"), "file://" + os.path.join(root, "durable")
    rank = int(os.environ["RANK"])
    state = {"w": torch.arange(16.0)}
    dist.barrier()
    if os.environ["FAULT_PHASE"] == "restart":
        with CheckpointManager(local, timeout_seconds=timeout_s, durable_url=durable, keep_last=2) as mgr:
            assert mgr.wait_durable(60)
            steps = mgr.all_steps()
        tiers = read_manifest(Path(local) / "step_000000003").tiers if rank == 0 else {}
        return {"steps": steps, "listing": sorted(os.listdir(local)), "durable": "durable" in tiers,
                "durable_listing": sorted(os.listdir(os.path.join(root, "durable")))}
    real_broadcast = DistContext.broadcast

    def dying(self, obj, *, background=False, what="broadcast"):
        if rank == 1 and what == "commit" and STEP[0] == 3:
            time.sleep(1.0)  # rank 0 renames meanwhile (it renames before this broadcast)
            os._exit(9)
        return real_broadcast(self, obj, background=background, what=what)

    STEP = [0]
    DistContext.broadcast = dying
    if rank == 0:  # the launcher ends rank 0 right after: nothing runs after the commit of step 3
        real_after = commit_mod.CommitFollowUp.run

        def after(self, step, final, replicate=False):
            return None if step == 3 else real_after(self, step, final, replicate)

        commit_mod.CommitFollowUp.run = after
    mgr = CheckpointManager(local, timeout_seconds=timeout_s, durable_url=durable, keep_last=2)
    for step in (1, 2):
        STEP[0] = step
        mgr.save(step, state)
        mgr.wait()
        assert mgr.wait_durable(60)
    STEP[0] = 3
    try:
        mgr.save(3, state)
        mgr.wait()
        outcome = "committed"
    except CheckpointError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    return {"outcome": outcome, "listing": sorted(os.listdir(local))}


def main() -> None:
    import torch.distributed as dist

    scenario, root, persist = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    timeout_s = float(os.environ.get("FAULT_TIMEOUT_S", "3"))
    result = {"slow_shard": slow_shard, "efbig_download": efbig_download, "eio_restore": eio_restore,
              "killed_after_rename": killed_after_rename}[
        scenario](root, persist, timeout_s)
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
