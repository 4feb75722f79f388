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
    import torch_ckpt.persist as persist_mod

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


def main() -> None:
    import torch.distributed as dist

    scenario, root, persist = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    result = {"slow_shard": lambda: slow_shard(root, persist, float(os.environ.get("FAULT_TIMEOUT_S", "3")))}[
        scenario]()
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
