"""A minimal torchrun worker: joins the process group, all-reduces its rank, exits."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank())])
dist.all_reduce(value)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {value.item():g}", flush=True)
dist.destroy_process_group()
