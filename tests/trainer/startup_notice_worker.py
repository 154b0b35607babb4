"""Run by test_startup_notice.py under trainer.launch (torchrun): the trainer, whose node gets a
notice while it loads, before its round's first step.

python -m trainer.launch --standalone --nproc-per-node=1 \
    tests/trainer/startup_notice_worker.py trainer-args...

Once the model and data are loaded (resuming from a checkpoint comes next), the worker sends its
torchrun agent SIGTERM, as Kubernetes sends the pod's first process, and waits: the agent marks
the notice and passes it on, and the worker ends at once.
"""

import os
import signal
import sys
import time

import trainer.train as train_module
from trainer.train import main


def resume(self):
    os.kill(os.getppid(), signal.SIGTERM)  # the agent: torchrun in trainer.launch's process
    time.sleep(120)  # the notice ends the wait
    raise RuntimeError("no notice came within 120 s")


train_module.Trainer.resume = resume
main(sys.argv[1:])
