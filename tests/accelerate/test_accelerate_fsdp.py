"""FSDP2 through Accelerate's FSDP plugin. Accelerate enables its FSDP plugin only for GPU-like
distributed types (not MULTI_CPU, checked in accelerate 1.15.0), so this test needs a CUDA device."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("accelerate")

SCRIPT = """
import sys, torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin, ProjectConfiguration
import accelerate_ckpt

project, phase = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
                  project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True))
assert str(acc.distributed_type).endswith("FSDP"), acc.distributed_type
ckpt = accelerate_ckpt.attach(acc)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = acc.prepare(model, opt)
steps = range(6) if phase == "ref" else range(3) if phase == "save" else range(3, 6)
if phase == "resume":
    acc.load_state()
for i in steps:
    torch.manual_seed(100 + i)
    loss = model(torch.randn(4, 8).to(acc.device)).pow(2).mean()
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    print(repr(loss.item()))
if phase == "save":
    acc.save_state(step=3)
ckpt.close()
"""


def _run(tmp_path, phase: str) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / phase.replace("resume", "save")), phase],
                          capture_output=True, text=True, timeout=240, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


@pytest.mark.cuda
@pytest.mark.timeout(600)
def test_fsdp2_plugin_save_and_resume_matches_the_uninterrupted_run(tmp_path):
    """FSDP2 via FullyShardedDataParallelPlugin: save after 3 steps, resume in a new process, losses bit for bit."""
    reference = _run(tmp_path, "ref")
    assert _run(tmp_path, "save") == reference[:3]
    assert _run(tmp_path, "resume") == reference[3:]
