"""Run by test_crash_during_save.py: the trainer, killed (SIGKILL) in the middle of a save.

python tests/trainer/crash_save_worker.py SAVE_NUMBER trainer-args...

The SAVE_NUMBER-th checkpoint save dies after DCP wrote this rank's shards, before the save was
made complete (trainer_state.json and the rename), as a process killed mid-save does.
"""

import os
import signal
import sys

import torch.distributed.checkpoint as dcp

from trainer.train import main

crash_at, saves = int(sys.argv[1]), 0
real_save = dcp.save


def save_then_die(*args, **kwargs):
    global saves
    saves += 1
    result = real_save(*args, **kwargs)
    if saves == crash_at:
        print(f"killed during save {saves}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return result


dcp.save = save_then_die
main(sys.argv[2:])
