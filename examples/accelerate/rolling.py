"""One rolling checkpoint folder: ``save_state("OUT/latest")`` every N steps, overwriting the previous one.

A restart resumes from ``OUT/latest`` when it exists. ``--attach`` is the only difference; with it,
each save replaces ``latest`` atomically, so a crash mid-save leaves the previous one loadable.
"""

import os

from tiny import Progress, arguments, batches, setup, train_step

args = arguments(output_dir=str)
acc, ckpt, model, opt, sched, loader = setup(args)
progress = Progress()
acc.register_for_checkpointing(progress)
latest = os.path.join(args.output_dir, "latest")
if os.path.isdir(latest):
    acc.load_state(latest)
data = batches(acc, loader, progress.step)
while progress.step < args.steps:
    progress.step += 1
    train_step(args, acc, model, opt, sched, next(data), progress.step)
    if progress.step % args.save_every == 0:
        acc.save_state(latest)
if ckpt is not None:
    ckpt.close()
