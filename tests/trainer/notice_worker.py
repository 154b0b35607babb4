"""Run by test_notice_eval.py: the trainer alone, a notice (SIGTERM) coming during a given step,
or during the final eval (after the last step).

python tests/trainer/notice_worker.py STEP|final-eval trainer-args...

Alone (no torchrun agent's marker) a SIGTERM is a notice: the trainer saves the step and exits
with PREEMPTED_EXIT_CODE, as a pod's trainer does when its node is reclaimed.
"""

import os
import signal
import sys

import trainer.train as train_module
from trainer.train import main

when = sys.argv[1]
real_step, real_finish = train_module.Trainer.step, train_module.Trainer.finish


def step(self, state):
    if when != "final-eval" and state.step + 1 == int(when):
        os.kill(os.getpid(), signal.SIGTERM)
    return real_step(self, state)


def finish(self, state):
    real_eval = self.eval_and_log

    def eval_and_log(state):
        os.kill(os.getpid(), signal.SIGTERM)  # noted; the eval goes on
        return real_eval(state)

    if when == "final-eval":
        self.eval_and_log = eval_and_log
    return real_finish(self, state)


train_module.Trainer.step = step
train_module.Trainer.finish = finish
main(sys.argv[2:])
