"""Tensor parallelism with sequence parallelism (DTensor) for the architecture table's families.

The layout is Megatron's, as torchtitan applies it to Llama: inside a decoder block the attention
heads and the MLP's hidden units are split over the "tp" ranks (q/k/v and gate/up column-wise,
o_proj/down_proj row-wise), and between the matmuls (norms, residual adds) the activations are
split along the sequence instead, so no rank holds a whole (batch, seq_len, hidden) activation.
FSDP then shards the resulting DTensors over the data-parallel dims of the same mesh. Each
family's block plan is a row of finetune_contract.families (its norms, per-head or
whole-projection q/k norms); the styles are here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from transformers import PreTrainedModel

from finetune_contract import families
from finetune_contract.data import IGNORE_INDEX
from trainer.batch import Batch
from trainer.blocks import decoder_blocks

TP_DIM = "tp"


def data_parallel_rank(rank: int, world_size: int, tp_degree: int) -> tuple[int, int]:
    """(this rank's index among the data-parallel replicas, their number).

    The ranks of one TP group hold the consecutive global ranks (tp is the mesh's last dim), and
    they must see the same batch.
    """
    return rank // tp_degree, world_size // tp_degree


def mesh_plan(
    fsdp_shape: tuple[int, ...], fsdp_names: tuple[str, ...], tp_degree: int
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The device mesh with "tp" as the innermost dim, so a TP group stays within a node."""
    return (*fsdp_shape, tp_degree), (*fsdp_names, TP_DIM)


def apply_tensor_parallel(model: PreTrainedModel, tp_mesh: DeviceMesh) -> None:
    """Split every decoder block, the embedding and the LM head over `tp_mesh` (1-D)."""
    plan = block_plan(families.family_of(model.config))
    for block in decoder_blocks(model):
        parallelize_module(block, tp_mesh, plan)
    parallelize_module(model.model.norm, tp_mesh, SequenceParallel())
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head.weight is embedding.weight
    if embedding.weight.shape[0] % tp_mesh.size() == 0:
        # DTensor out (not local): HF derives positions and the causal mask from its shape.
        embedding_style = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
        parallelize_module(embedding, tp_mesh, embedding_style)
        # model(...) gets whole logits on every rank; the training loss (trainer/loss.py) uses
        # the vocabulary-sharded weight directly, on each rank's part of the sequence.
        head_style = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
        parallelize_module(head, tp_mesh, head_style)
    else:
        # FSDP cannot shard a dim that TP split unevenly: keep the whole vocab on every TP rank.
        distribute_module(embedding, tp_mesh, input_fn=_replicate_input, output_fn=_shard_sequence)
        distribute_module(head, tp_mesh, input_fn=_replicate_input, output_fn=_to_local)
    if tied:
        # Both got the same placement (vocab-sharded or replicated): one DTensor serves both again.
        head.weight = embedding.weight


def _replicate_input(module: torch.nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> Any:
    x = inputs[0]
    if isinstance(x, DTensor):
        return (x.redistribute(mesh, [Replicate()]), *inputs[1:])
    return (DTensor.from_local(x, mesh, [Replicate()], run_check=False), *inputs[1:])


def _shard_sequence(module: torch.nn.Module, output: DTensor, mesh: DeviceMesh) -> DTensor:
    return output.redistribute(mesh, [Shard(1)])


def _to_local(module: torch.nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    return output.to_local()


class _ProjectionNorm(ParallelStyle):
    """A norm over a whole column-split projection (OLMo 2's q/k norms): its weight split as the
    projection's features, its input the projection's DTensor output, so the mean of squares
    is reduced across the ranks; out: this rank's features, local."""

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        def partition(name: str, part: torch.nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(part.named_parameters(recurse=False)):
                part.register_parameter(key, torch.nn.Parameter(
                    distribute_tensor(param, mesh, [Shard(0)]), param.requires_grad))

        return distribute_module(module, device_mesh, partition, output_fn=_to_local)


def _styles() -> dict[str, ParallelStyle]:
    """The architecture table's tensor-parallel styles (finetune_contract.families)."""
    return {
        families.COLWISE: ColwiseParallel(),
        families.COLWISE_DTENSOR: ColwiseParallel(use_local_output=False),
        families.ROWWISE: RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        families.SEQUENCE_NORM: SequenceParallel(),
        # Row-wise over head_dim: any split but the last gives each rank whole rows; the weight's
        # gradient is the ranks' sum (SequenceParallel marks it partial).
        families.HEAD_NORM: SequenceParallel(use_local_output=True),
        families.PROJECTION_NORM: _ProjectionNorm(),
        # HF passes hidden_states to attention by keyword.
        families.ATTENTION_INPUT: PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        ),
        families.MLP_INPUT: PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
            use_local_output=True,
        ),
    }


def block_plan(family: families.Family) -> dict[str, ParallelStyle]:
    """The family's block plan as parallelize_module takes it; ValueError where it has none."""
    if family.tp_refused or not family.tp_plan:
        raise ValueError(f"tp_degree > 1 with {family.label} ({family.model_type}): "
                         f"{family.tp_refused or 'no tensor-parallel plan'}")
    styles = _styles()
    return {path: styles[style] for path, style in family.tp_plan}


def pad_to_multiple(batch: Batch, multiple: int, pad_id: int) -> Batch:
    """Right-pad every (batch, length) tensor so that length divides into `multiple` parts.

    Pads come last, so under causal attention no real token sees them; they carry no loss.
    """
    length = batch.input_ids.shape[1]
    extra = -length % multiple
    if extra == 0:
        return batch
    pad_values = {"input_ids": pad_id, "labels": IGNORE_INDEX}
    padded: dict[str, Any] = {}
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        if isinstance(value, torch.Tensor) and value.shape[:2] == batch.input_ids.shape:
            pad = torch.full(
                (value.shape[0], extra, *value.shape[2:]),
                pad_values.get(field.name, 0),
                dtype=value.dtype,
                device=value.device,
            )
            padded[field.name] = torch.cat([value, pad], dim=1)
    return dataclasses.replace(batch, **padded)


class SequenceParallelBatches:
    """`batches` (an iterator or a re-iterable) with each batch padded for sequence parallelism."""

    def __init__(self, batches: Iterable[Batch], tp_degree: int, pad_id: int):
        self.batches, self.tp_degree, self.pad_id = batches, tp_degree, pad_id

    def __iter__(self) -> Iterator[Batch]:
        if isinstance(self.batches, Iterator):
            return self
        return (pad_to_multiple(b, self.tp_degree, self.pad_id) for b in self.batches)

    def __next__(self) -> Batch:
        return pad_to_multiple(next(self.batches), self.tp_degree, self.pad_id)  # type: ignore[call-overload]

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]
