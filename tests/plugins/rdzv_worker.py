"""A minimal torchrun worker: joins the process group, all-reduces its rank, exits.

With RDZV_WORKER_FAIL_RANK=r, rank r fails in torchrun's first round and, in the restarted
round, joins the process group late, so its peers look up its address before it sets it.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

fail_rank = int(os.environ.get("RDZV_WORKER_FAIL_RANK", -1))
restarted = os.environ["TORCHELASTIC_RESTART_COUNT"] != "0"
if restarted and int(os.environ["RANK"]) == fail_rank:
    time.sleep(3)
dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank())])
dist.all_reduce(value)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {value.item():g}", flush=True)
if dist.get_rank() == fail_rank and not restarted:
    sys.exit(f"rank {fail_rank} fails in the first round")
dist.destroy_process_group()
