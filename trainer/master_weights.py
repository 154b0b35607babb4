"""One rank, one device, no sharding: fp32 master weights with low-precision compute copies.

FSDP2 on a mesh of one still runs its machinery as copies: every forward casts each fp32 weight
into a staging buffer and copies it again into the unsharded parameter, and every backward copies
the gradients into a reduce buffer, again into the output, then casts them to fp32 (~40 ms of a
660 ms 3B step on an H200, profiled). Without FSDP the same numerics cost one cast each way:

- the model's parameters hold the fp32 masters, which the optimizer, clipping, checkpoints and
  export see, as they see FSDP's sharded fp32 parameters; a frozen parameter (LoRA's base) is
  made in the compute dtype from the start (`frozen_in_compute_dtype`): it never steps, the
  compute reads only that, and an fp32 master would cost 4 bytes a parameter for nothing (8B
  LoRA: 30 GiB);
- inside `compute_weights(model)` the parameters hold bf16 (or fp16) copies, made again only for
  masters that changed since: after an optimizer step (a step hook: on the H200 the fused AdamW
  step left the version counters where they were), or a write that moved a version counter (a
  checkpoint load);
- each gradient is cast to fp32 as soon as backward has it, freeing the low-precision one, and
  added to the master's gradient: gradient accumulation is in fp32, as FSDP's;
- a trained float8 Linear (torchao's Float8Linear) casts its weight to float8 at every use; where
  `finetune_contract.rules.float8_reads_masters` says so (no micro batches to accumulate, or the
  rowwise recipe) it reads its fp32 master, with no bf16 copy, and its gradient arrives in fp32;
- when micro batches accumulate (`grad_accum` > 1), a block Linear's weight gradient skips that
  cast and add: its GEMM adds dy^T @ x into the fp32 gradient itself (cuBLAS with beta 1 and an
  fp32 output, Megatron's gradient-accumulation fusion; `GradIntoLinear`). The gradients are
  then the fp32 sums of fp32 products, where the cast-and-add rounds each micro batch's
  gradient to bf16 first (Hugging Face Trainer's autocast does too): closer to fp32, not equal.

With `reshard` (FULL_SHARD or HYBRID_SHARD on one process: the run asked for the least memory)
a decoder block's copies exist only while it runs, as FSDP's gathered weights do: made from the
masters just before its forward, freed after it, made again when backward reaches the block
(before any recompute) and freed when backward moves on to the block before it. The embeddings,
final norm and head keep theirs for the step, as FSDP's root does. An 8B full fine-tune then
holds a block or two of bf16 copies (0.4 GiB each) where it held all of them (15 GiB), at the
cost of one more cast per block a micro batch: FSDP at one rank copies each weight three times
each way, the reason to leave it.

The Parameter objects stay the same (their `.data` is swapped), so optimizer state, hooks and
compiled blocks keep referring to them; a resharded copy is freed by resizing its storage to
nothing (autograd's saved references see it made again), as FSDP does.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Iterator

import torch

from trainer.blocks import decoder_blocks
from trainer.float8 import is_float8_linear
from trainer.qlora import is_quantized

ATTRIBUTE = "_trainer_master_weights"
# "0" keeps the cast-and-add for every weight: the benchmark's A/B of the fusion.
GRAD_INTO_GEMM_ENV = "TRAINER_GRAD_INTO_GEMM"
# "0" gives float8 Linears bf16 copies too where they would read their masters
# (finetune_contract.rules.float8_reads_masters): the benchmark's A/B only. The planner plans
# without those copies, so a run with it uses more memory than validate planned (2 bytes a weight).
FLOAT8_MASTERS_ENV = "TRAINER_FLOAT8_MASTERS"


@torch.library.custom_op("trainer::weight_grad_into", mutates_args=("grad",))
def weight_grad_into(grad: torch.Tensor, grad_output: torch.Tensor, x: torch.Tensor) -> None:
    """grad (fp32) += grad_output^T @ x, summed over every leading dimension, in one GEMM.

    An op of its own: a compiled block's backward calls it as it is, on the gradient in place.
    On CUDA the GEMM reads and writes the fp32 gradient (beta 1, fp32 output); elsewhere the
    same arithmetic in fp32 (the CPU has no mixed-dtype GEMM).
    """
    dy = grad_output.reshape(-1, grad_output.shape[-1]).t()
    inputs = x.reshape(-1, x.shape[-1])
    if grad.is_cuda:
        torch.addmm(grad, dy, inputs, out_dtype=torch.float32, out=grad)
    else:
        grad.addmm_(dy.float(), inputs.float())


@weight_grad_into.register_fake
def _(grad: torch.Tensor, grad_output: torch.Tensor, x: torch.Tensor) -> None:
    return None


class _LinearGradInto(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, grad)
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, grad = ctx.saved_tensors
        weight_grad_into(grad, grad_output, x)
        grad_bias = (grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
                     if ctx.has_bias and ctx.needs_input_grad[2] else None)
        grad_x = grad_output @ weight if ctx.needs_input_grad[0] else None
        return grad_x, None, grad_bias, None


class GradIntoLinear(torch.nn.Linear):
    """A trained block Linear of a one-rank run that accumulates micro batches: inside
    compute_weights its weight's gradient goes into the fp32 master gradient by the GEMM that
    makes it (`grad_into`, set by MasterWeights); elsewhere a plain Linear."""

    grad_into: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grad_into is None:
            return super().forward(x)
        return _LinearGradInto.apply(x, self.weight, self.bias, self.grad_into)


class MasterWeights:
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, grad_into_gemm: bool = False,
                 reshard: bool = False, float8_masters: bool = False):
        self.model = model
        self.dtype = dtype
        self.params: list[torch.nn.Parameter] = []
        self.copies: list[torch.Tensor | None] = []
        self.versions: list[int | None] = []
        self.grads: list[torch.Tensor | None] = []
        self.masters: list[torch.Tensor] = []  # inside compute: what the parameters held
        self.active = False
        # reshard: each block's copies only while it runs (the module doc)
        self.blocks: list[torch.nn.Module] = list(decoder_blocks(model)) if reshard else []
        self.block_params: list[list[int]] = []  # per block, its resharded parameters' indices
        self.made: list[bool] = []  # per block, whether its copies exist now
        self.backward_block: int | None = None  # the block backward is in
        owner = weakref.ref(self)
        for b, block in enumerate(self.blocks):
            block.register_forward_pre_hook(functools.partial(_block_forward, owner, b))
            block.register_forward_hook(functools.partial(_block_forward_done, owner, b))
        # The block Linears whose weight gradient its GEMM accumulates (GradIntoLinear).
        self.linears: list[GradIntoLinear] = []
        if grad_into_gemm:
            for module in decoder_blocks(model).modules():
                if type(module) is torch.nn.Linear and module.weight.requires_grad:
                    module.__class__ = GradIntoLinear
                    self.linears.append(module)
        self.fused: list[tuple[int, GradIntoLinear]] = []
        self.kept: set[int] = set()  # parameters the compute reads as they are: their masters
        self.float8_masters = float8_masters  # float8 Linears read theirs (_bind)

    def _bind(self) -> None:
        """The parameters as they are once materialized (tying may replace Parameter objects)."""
        # QLoRA's 4-bit base (trainer/qlora.py) is frozen and dequantized by its own matmul.
        params = [p for p in self.model.parameters() if not is_quantized(p)]
        if [id(p) for p in params] == [id(p) for p in self.params]:
            return
        self.params = params
        self.copies = [None] * len(params)
        self.versions = [None] * len(params)
        self.grads = [None] * len(params)
        # A weak reference: the hook lives in C++ autograd metadata, which the garbage collector
        # cannot see through, so a strong one would keep the model alive for good.
        this = weakref.ref(self)
        for i, param in enumerate(params):
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(functools.partial(_to_master, this, i))
        index = {id(p): i for i, p in enumerate(params)}
        self.fused = [(index[id(m.weight)], m) for m in self.linears]
        # A trained float8 Linear's weight (torchao's Float8Linear) is cast to float8 at each
        # use, from whatever it holds: with float8_masters (rules.float8_reads_masters) it reads
        # its fp32 master, as torchtitan's float8 does, so no bf16 copy is made for it and its
        # gradient is fp32 when backward hands it over.
        float8 = ({id(m.weight) for m in self.model.modules() if is_float8_linear(m)}
                  if self.float8_masters else set())
        self.kept = {i for i, p in enumerate(params) if id(p) in float8 and p.requires_grad}
        # Only a trained weight has a copy of its own to free; a frozen one is its copy.
        self.block_params = [[index[id(p)] for p in block.parameters()
                              if id(p) in index and p.requires_grad
                              and index[id(p)] not in self.kept] for block in self.blocks]
        self.made = [False] * len(self.blocks)

    def stepped(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        """An optimizer step hook: its parameters changed (LoRA's frozen base did not)."""
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for i, param in enumerate(self.params):
            if id(param) in stepped:
                self.versions[i] = None

    def to_master(self, i: int, param: torch.Tensor) -> None:
        if not self.active:
            raise RuntimeError(
                "backward ran outside compute_weights(model): run forward and backward inside it"
            )
        grad = param.grad
        if grad is None:  # a GradIntoLinear's weight: its GEMM accumulated the gradient
            return
        param.grad = None
        if self.grads[i] is None:
            self.grads[i] = grad.to(torch.float32)
        else:
            self.grads[i].add_(grad)

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        if self.active:  # nested: already in compute precision
            yield
            return
        self._bind()
        masters = self.masters = [p.data for p in self.params]
        resharded = {i for indices in self.block_params for i in indices}
        stale = [i for i, p in enumerate(self.params)
                 if p._version != self.versions[i] and i not in self.kept]
        for i in stale:
            if (self.copies[i] is None and masters[i].dtype == self.dtype
                    and not self.params[i].requires_grad):
                self.copies[i] = masters[i]  # a frozen weight made in the compute dtype
            elif self.copies[i] is None:
                self.copies[i] = torch.empty_like(masters[i], dtype=self.dtype)
                if i in resharded:  # made by its block's forward (_make): freed at once
                    _free(self.copies[i])
        for i in resharded:  # any left by a step that stopped midway
            _free(self.copies[i])
        self.made = [False] * len(self.blocks)
        self.backward_block = None
        stale = [i for i in stale if self.copies[i] is not masters[i] and i not in resharded]
        if stale:
            with torch.no_grad():
                torch._foreach_copy_([self.copies[i] for i in stale], [masters[i] for i in stale])
        for i in stale:  # a frozen weight never steps: its copy is all it keeps, fp32 freed
            if not self.params[i].requires_grad:
                masters[i] = self.copies[i]
        for i, param in enumerate(self.params):
            self.grads[i] = param.grad  # fp32 from an earlier micro batch: accumulated onto
            param.grad = None
            if i not in self.kept:
                param.data = self.copies[i]
        try:  # from here on, whatever fails puts the masters and their gradients back
            if torch.is_grad_enabled():  # a backward may follow: the fused GEMMs' fp32 gradients
                for i, module in self.fused:
                    if self.grads[i] is None:
                        self.grads[i] = torch.zeros_like(masters[i], dtype=torch.float32)
                    module.grad_into = self.grads[i]
            self.active = True
            yield
        finally:
            self.active = False
            for b in range(len(self.blocks)):
                self._unmake(b)
            self.backward_block = None
            for _, module in self.fused:
                module.grad_into = None
            for i, param in enumerate(self.params):
                param.grad = None  # a low-precision gradient no hook took (backward unfinished)
                param.data = masters[i]
                param.grad = self.grads[i]
                self.grads[i] = None
                self.versions[i] = param._version
            self.masters = []

    def _make(self, b: int) -> None:
        """Block b's copies, cast from the masters (its forward, or backward reaching it)."""
        if not self.active or self.made[b]:
            return
        indices = self.block_params[b]
        for i in indices:
            copy = self.copies[i]
            copy.untyped_storage().resize_(copy.numel() * copy.element_size())
        with torch.no_grad():
            torch._foreach_copy_([self.copies[i] for i in indices],
                                 [self.masters[i] for i in indices])
        self.made[b] = True

    def _unmake(self, b: int) -> None:
        if self.made[b]:
            for i in self.block_params[b]:
                _free(self.copies[i])
            self.made[b] = False

    def forward_done(self, b: int, output: object) -> None:
        """After block b's forward: free its copies; if a backward will come through it, make
        them again when it does, and free the block backward leaves then."""
        if not self.active or torch._C._current_graph_task_id() != -1:
            return  # outside compute, or a recompute inside backward: backward frees
        self._unmake(b)
        outputs = [t for t in torch.utils._pytree.tree_leaves(output)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs:
            torch.autograd.graph.register_multi_grad_hook(
                outputs, functools.partial(_block_backward, weakref.ref(self), b), mode="any")

    def backward_reached(self, b: int) -> None:
        if self.backward_block is not None and self.backward_block != b:
            self._unmake(self.backward_block)
        self.backward_block = b
        self._make(b)


def _free(copy: torch.Tensor | None) -> None:
    if copy is not None:
        copy.untyped_storage().resize_(0)


def _block_forward(owner: weakref.ref[MasterWeights], b: int, *_: object) -> None:
    master_weights = owner()
    if master_weights is not None:
        master_weights._make(b)


def _block_forward_done(owner: weakref.ref[MasterWeights], b: int, _module: object,
                        _args: object, output: object) -> None:
    master_weights = owner()
    if master_weights is not None:
        master_weights.forward_done(b, output)


def _block_backward(owner: weakref.ref[MasterWeights], b: int, _grad: object) -> None:
    master_weights = owner()
    if master_weights is not None:
        master_weights.backward_reached(b)


def frozen_in_compute_dtype(model: torch.nn.Module) -> None:
    """Before the weights are allocated (on the meta device): with master weights, a frozen
    floating weight (LoRA's base, its embeddings and head) is made in the compute dtype, since
    its copy is all it keeps anyway; so no fp32 copy of it ever exists, where before the first
    step held both (8B LoRA: 45 GiB at the first step for 20 after). A no-op without master
    weights (FSDP keeps fp32 shards) and for QLoRA's NF4 placeholders (empty)."""
    master_weights: MasterWeights | None = getattr(model, ATTRIBUTE, None)
    if master_weights is None:
        return
    for param in model.parameters():
        if (param.is_meta and param.numel() and param.is_floating_point()
                and not param.requires_grad):
            param.data = torch.empty_like(param, dtype=master_weights.dtype)


def _to_master(master_weights: weakref.ref[MasterWeights], i: int, param: torch.Tensor) -> None:
    owner = master_weights()
    if owner is not None:
        owner.to_master(i, param)


def use_master_weights(model: torch.nn.Module, dtype: torch.dtype, grad_accum: int = 1,
                       reshard: bool = False, float8_masters: bool = False) -> None:
    """Make `model` compute in `dtype` inside `compute_weights(model)`; its masters stay fp32.
    With micro batches to accumulate, the block Linears' GEMMs accumulate their gradients.
    reshard: a block's copies only while it runs (after any wrapping and compiling of the
    blocks: the hooks go on the modules the model calls)."""
    grad_into_gemm = grad_accum > 1 and os.environ.get(GRAD_INTO_GEMM_ENV, "1") != "0"
    float8_masters = float8_masters and os.environ.get(FLOAT8_MASTERS_ENV, "1") != "0"
    setattr(model, ATTRIBUTE, MasterWeights(model, dtype, grad_into_gemm, reshard, float8_masters))


def follow_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Copy the masters again after each step of `optimizer` (a no-op without master weights)."""
    master_weights: MasterWeights | None = getattr(model, ATTRIBUTE, None)
    if master_weights:
        optimizer.register_step_post_hook(master_weights.stepped)


def compute_weights(model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """Run forward and backward inside this: the weights in compute precision, gradients to the
    masters at the end. A no-op for a model without master weights (FSDP casts by itself)."""
    master_weights: MasterWeights | None = getattr(model, ATTRIBUTE, None)
    return master_weights.compute() if master_weights else contextlib.nullcontext()
