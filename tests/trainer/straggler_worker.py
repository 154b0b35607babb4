"""Run by test_hang.py under torchrun: the trainer with one rank slow to get its batches.

python tests/trainer/straggler_worker.py SLOW_RANK DELAY_S trainer-args...
"""

import os
import sys
import time

import trainer.train
from trainer.data import TrainBatches

slow_rank, delay_s = int(sys.argv[1]), float(sys.argv[2])


class SlowBatches(TrainBatches):
    def __next__(self):
        if int(os.environ["RANK"]) == slow_rank:
            time.sleep(delay_s)  # a slow data source or host on this rank only
        return super().__next__()


trainer.train.TrainBatches = SlowBatches
trainer.train.main(sys.argv[3:])
