"""Tensor parallelism with sequence parallelism (DTensor) for the architecture table's families.

The layout is Megatron's, as torchtitan applies it to Llama: inside a decoder block the attention
heads and the MLP's hidden units are split over the "tp" ranks (q/k/v and gate/up column-wise,
o_proj/down_proj row-wise), and between the matmuls (norms, residual adds) the activations are
split along the sequence instead, so no rank holds a whole (batch, seq_len, hidden) activation.
FSDP then shards the resulting DTensors over the data-parallel dims of the same mesh. Each
family's block plan is a row of finetune_contract.families (its norms, per-head or
whole-projection q/k norms, fused projections); the styles are here.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
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


def apply_tensor_parallel(model: PreTrainedModel, tp_mesh: DeviceMesh) -> None:
    """Split every decoder block, the embedding and the LM head over `tp_mesh` (1-D)."""
    plan = block_plan(families.family_of(model.config), model.config)
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


class FusedColwiseLinear(torch.nn.Linear):
    """A fused projection (Phi-3's qkv_proj: q, k, v side by side; gate_up_proj: gate, up) split
    column-wise piece by piece: this rank computes its part of every piece, [q_r | k_r | v_r],
    which is what the attention (told the rank's head counts) and the MLP's chunk expect.

    The weight (and bias) stay a plain row split of the checkpoint's layout (Shard(0)), so
    random init, loading, DCP checkpoints (resumable at any tp_degree), the export and FSDP see
    what they see of any Linear. Each forward gathers the weight over the tp ranks (its gradient
    is reduce-scattered back) and takes this rank's rows of every piece: one all-gather of the
    weight per projection, where a plain column split has none; the activations stay split.
    """

    tp_mesh: DeviceMesh
    rows: tuple[tuple[int, int], ...]  # (start, length) in the gathered weight, piece by piece

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = self.tp_mesh
        if isinstance(x, DTensor):
            x = x.redistribute(mesh, [Replicate()]).to_local()
        # Every rank's output part contributes to the input's gradient: all-reduce it.
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(
            grad_placements=[Partial()])
        weight = _rows(_gathered(self.weight, mesh), self.rows)
        bias = None if self.bias is None else _rows(_gathered(self.bias, mesh), self.rows)
        return torch.nn.functional.linear(x, weight, bias)


def _gathered(param: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The whole of a row-split parameter; its gradient (this rank's rows of it nonzero) is
    summed over the ranks and each keeps its shard (reduce-scatter)."""
    if not isinstance(param, DTensor):
        return param
    return param.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def _rows(tensor: torch.Tensor, rows: tuple[tuple[int, int], ...]) -> torch.Tensor:
    return torch.cat([tensor.narrow(0, start, length) for start, length in rows])


class _FusedColwise(ParallelStyle):
    """families.COLWISE_FUSED: a Linear whose output is `pieces` side by side."""

    def __init__(self, pieces: tuple[int, ...]):
        self.pieces = pieces

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        if type(module) is not torch.nn.Linear:
            raise ValueError(f"colwise_fused takes an nn.Linear, not {type(module).__name__}")
        size, rank = device_mesh.size(), device_mesh.get_local_rank()
        rows, start = [], 0
        for piece in self.pieces:
            if piece % size:
                raise ValueError(f"tp_degree {size} does not divide a fused piece of {piece}")
            rows.append((start + rank * (piece // size), piece // size))
            start += piece

        def partition(name: str, part: torch.nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(part.named_parameters(recurse=False)):
                part.register_parameter(key, torch.nn.Parameter(
                    distribute_tensor(param, mesh, [Shard(0)]), param.requires_grad))

        distribute_module(module, device_mesh, partition)
        module.__class__ = FusedColwiseLinear
        module.tp_mesh, module.rows = device_mesh, tuple(rows)
        return module


class _RankHeads(ParallelStyle):
    """families.ATTENTION_INPUT_RANK_HEADS: ATTENTION_INPUT, and the attention module's head
    counts made this rank's (a fused qkv is sliced at heads x head_dim, not split by -1)."""

    def __init__(self, attention_input: ParallelStyle):
        self.attention_input = attention_input

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        size = device_mesh.size()
        # A copy of the model's config for this module only: the model (masks, rotary) keeps
        # the whole model's counts.
        config = copy.copy(module.config)
        config.num_attention_heads //= size
        config.num_key_value_heads //= size
        module.config = config
        module.num_key_value_heads = config.num_key_value_heads
        return self.attention_input._apply(module, device_mesh)


def _styles() -> dict[str, ParallelStyle]:
    """The architecture table's tensor-parallel styles (finetune_contract.families)."""
    attention_input = PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Shard(1)},
        desired_input_kwarg_layouts={"hidden_states": Replicate()},
        use_local_output=True,
    )
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
        families.ATTENTION_INPUT: attention_input,
        families.ATTENTION_INPUT_RANK_HEADS: _RankHeads(attention_input),
        families.MLP_INPUT: PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
            use_local_output=True,
        ),
    }


def block_plan(family: families.Family, config: Any) -> dict[str, ParallelStyle]:
    """The family's block plan as parallelize_module takes it, for `config`'s shapes (a fused
    projection's pieces); ValueError where it has none."""
    if family.tp_refused or not family.tp_plan:
        raise ValueError(f"tp_degree > 1 with {family.label} ({family.model_type}): "
                         f"{family.tp_refused or 'no tensor-parallel plan'}")
    styles, linears = _styles(), {linear.path: linear for linear in family.linears}
    return {path: _FusedColwise(families.pieces(config, linears[path].fan_out))
            if style == families.COLWISE_FUSED else styles[style]
            for path, style in family.tp_plan}


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
