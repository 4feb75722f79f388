"""Accelerate's ``examples/by_feature/checkpointing.py`` loop: ``save_state(f"step_{n}")`` every N steps.

Resume with ``--resume-from-checkpoint OUT/step_N``: the step comes from the folder name, as in
Accelerate's example. ``--attach`` is the only difference between plain Accelerate and torch-ckpt.
"""

import os

from tiny import arguments, batches, setup, train_step

args = arguments(output_dir=str, resume_from_checkpoint=str)
acc, ckpt, model, opt, sched, loader = setup(args)
step = 0
if args.resume_from_checkpoint:
    acc.load_state(args.resume_from_checkpoint)
    step = int(os.path.basename(args.resume_from_checkpoint).replace("step_", ""))
data = batches(acc, loader, step)
while step < args.steps:
    step += 1
    train_step(args, acc, model, opt, sched, next(data), step)
    if step % args.save_every == 0:
        acc.save_state(os.path.join(args.output_dir, f"step_{step}"))
if ckpt is not None:
    ckpt.close()
