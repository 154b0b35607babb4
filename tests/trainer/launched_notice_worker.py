"""Run by test_startup_notice.py under trainer.launch (torchrun): the trainer, whose node gets a
notice (its torchrun agent SIGTERM, as Kubernetes sends the pod's first process) at a given
moment: while it imports (before the trainer can hear a notice), once the model and data are
loaded (before the round's first step), or during the export (after the last step).

NOTICE_WHEN=import|load|export python -m trainer.launch --standalone --nproc-per-node=1 \
    tests/trainer/launched_notice_worker.py trainer-args...

(An environment variable, not an argument: trainer.launch reads the output directory from the
trainer's arguments.)
"""

import os
import signal
import sys
import time

when = os.environ["NOTICE_WHEN"]


def notice() -> None:
    os.kill(os.getppid(), signal.SIGTERM)  # the agent: torchrun in trainer.launch's process


if when == "import":
    notice()
    time.sleep(120)  # the agent passes it on: SIGTERM's default action ends this process
    raise RuntimeError("no notice came within 120 s")

import trainer.train as train_module  # noqa: E402
from trainer.train import main  # noqa: E402

real_export = train_module.export_hf


def resume(self):
    notice()
    time.sleep(120)  # the notice ends the wait
    raise RuntimeError("no notice came within 120 s")


def export_hf(*args, **kwargs):
    notice()
    time.sleep(1)  # the agent passes it on and waits for its workers: this one goes on
    return real_export(*args, **kwargs)


if when == "load":
    train_module.Trainer.resume = resume
elif when == "export":
    train_module.export_hf = export_hf
main(sys.argv[1:])
