"""``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)``: ``save_state()`` every N steps.

The training step travels in a registered ``Progress`` object; a restart resumes with
``load_state()`` when ``PROJECT/checkpoints`` holds a checkpoint. ``--attach`` is the only difference.
"""

import os

from accelerate.utils import ProjectConfiguration
from tiny import Progress, arguments, batches, setup, train_step

args = arguments(project_dir=str)
project = ProjectConfiguration(project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=2)
acc, ckpt, model, opt, sched, loader = setup(args, project)
progress = Progress()
acc.register_for_checkpointing(progress)
checkpoints = os.path.join(args.project_dir, "checkpoints")
if os.path.isdir(checkpoints) and os.listdir(checkpoints):
    acc.load_state()
data = batches(acc, loader, progress.step)
while progress.step < args.steps:
    progress.step += 1
    train_step(args, acc, model, opt, sched, next(data), progress.step)
    if progress.step % args.save_every == 0:
        acc.save_state()
if ckpt is not None:
    ckpt.close()
