"""One rank, one device, no sharding: fp32 master weights with low-precision compute copies.

FSDP2 on a mesh of one still runs its machinery as copies: every forward casts each fp32 weight
into a staging buffer and copies it again into the unsharded parameter, and every backward copies
the gradients into a reduce buffer, again into the output, then casts them to fp32 (~40 ms of a
660 ms 3B step on an H200, profiled). Without FSDP the same numerics cost one cast each way:

- the model's parameters hold the fp32 masters, which the optimizer, clipping, checkpoints and
  export see, as they see FSDP's sharded fp32 parameters; a frozen parameter (LoRA's base) keeps
  its low-precision copy alone once made, for good: it never steps, the compute reads only the
  copy, and its fp32 master would cost 4 bytes a parameter for nothing (8B LoRA: 30 GiB);
- inside `compute_weights(model)` the parameters hold bf16 (or fp16) copies, made again only for
  masters that changed since: after an optimizer step (a step hook: on the H200 the fused AdamW
  step left the version counters where they were), or a write that moved a version counter (a
  checkpoint load);
- each gradient is cast to fp32 as soon as backward has it, freeing the low-precision one, and
  added to the master's gradient: gradient accumulation is in fp32, as FSDP's.

The Parameter objects stay the same (their `.data` is swapped), so optimizer state, hooks and
compiled blocks keep referring to them.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator

import torch

from trainer.qlora import is_quantized

ATTRIBUTE = "_trainer_master_weights"


class MasterWeights:
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        self.model = model
        self.dtype = dtype
        self.params: list[torch.nn.Parameter] = []
        self.copies: list[torch.Tensor | None] = []
        self.versions: list[int | None] = []
        self.grads: list[torch.Tensor | None] = []
        self.active = False

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
        masters = [p.data for p in self.params]
        stale = [i for i, p in enumerate(self.params) if p._version != self.versions[i]]
        for i in stale:
            if self.copies[i] is None:
                self.copies[i] = torch.empty_like(masters[i], dtype=self.dtype)
        if stale:
            with torch.no_grad():
                torch._foreach_copy_([self.copies[i] for i in stale], [masters[i] for i in stale])
        for i in stale:  # a frozen weight never steps: its copy is all it keeps, fp32 freed
            if not self.params[i].requires_grad:
                masters[i] = self.copies[i]
        for i, param in enumerate(self.params):
            self.grads[i] = param.grad  # fp32 from an earlier micro batch: accumulated onto
            param.grad = None
            param.data = self.copies[i]
        self.active = True
        try:
            yield
        finally:
            self.active = False
            for i, param in enumerate(self.params):
                param.grad = None  # a low-precision gradient no hook took (backward unfinished)
                param.data = masters[i]
                param.grad = self.grads[i]
                self.grads[i] = None
                self.versions[i] = param._version


def _to_master(master_weights: weakref.ref[MasterWeights], i: int, param: torch.Tensor) -> None:
    owner = master_weights()
    if owner is not None:
        owner.to_master(i, param)


def use_master_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Make `model` compute in `dtype` inside `compute_weights(model)`; its masters stay fp32."""
    setattr(model, ATTRIBUTE, MasterWeights(model, dtype))


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
