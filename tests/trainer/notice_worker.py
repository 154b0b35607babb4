"""Run by test_notice_eval.py: the trainer alone, a notice (SIGTERM) coming during a given step.

python tests/trainer/notice_worker.py STEP trainer-args...

Alone (no torchrun agent's marker) a SIGTERM is a notice: the trainer saves STEP and exits with
PREEMPTED_EXIT_CODE, as a pod's trainer does when its node is reclaimed.
"""

import os
import signal
import sys

import trainer.train as train_module
from trainer.train import main

notice_during, real_step = int(sys.argv[1]), train_module.Trainer.step


def step(self, state):
    if state.step + 1 == notice_during:
        os.kill(os.getpid(), signal.SIGTERM)
    return real_step(self, state)


train_module.Trainer.step = step
main(sys.argv[2:])
