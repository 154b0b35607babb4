"""Long sequences on one GPU: checkpointed blocks whose inputs wait in CPU memory, and tiled MLPs.

With `activation_checkpointing: full` a block keeps only its input for backward; at long
sequences those inputs are what grows (8B, 400k tokens: 3.3 GB a block, 105 GB for 32). With
`activation_offload` each block's forward is replaced (`offload_blocks`; the modules and their
parameter names stay as they were):

- forward runs the block without saving anything and copies its input to pinned CPU memory on a
  side stream, overlapping the next block's compute (`HostOffloader`); its GPU copy is freed
  once the transfer is done;
- backward brings the input back on another side stream (the block before it is fetched while
  this one computes), runs the block again with gradients and backpropagates through it: a
  reentrant checkpoint whose saved input lives in CPU memory.

The recomputed MLP is the other large part (8B: four 14,336-wide tensors a token): its
forward (`_Tiles`) runs it over slices of at most `MLP_TILE_TOKENS` tokens and at least
`MIN_MLP_TILES` of them (a 4-bit MLP's no smaller than 8,192 tokens), keeps only its
input, and in backward runs each slice again with gradients, one slice at a time; without
gradients (the checkpoint's forward, evaluation) it runs in slices too. Where a family's block
adds the MLP's output to the residual and reads it nowhere else (`Family.mlp_output_unread`),
the block's own recompute skips the MLP altogether (its values are never read; only its
backward is): the MLP runs twice a step, as under plain full checkpointing.

The block's modules are compiled one by one (`offload_blocks`' compile_backend): the checkpoint
and the tiles are Python around them, which a whole-block graph cannot hold.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from finetune_contract.rules import mlp_tiles

_state = threading.local()


def _recomputing() -> bool:
    return getattr(_state, "recomputing", False)


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    previous = _recomputing()
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = previous


class HostBuffers:
    """CPU buffers for offloaded inputs, page-locked once at their exact size and reused.

    torch's pinned allocator rounds each block up to a power of two (3.3 GB takes 4 GiB): 32 of
    them would ask 128 GiB of host memory for 105 GB of data. These are plain CPU tensors
    registered with CUDA (cudaHostRegister) at the size asked.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self.free: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        fitting = [i for i, b in enumerate(self.free) if b.numel() >= nbytes]
        if fitting:
            return self.free.pop(min(fitting, key=lambda i: self.free[i].numel()))
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if self.pin and nbytes:
            cudart = torch.cuda.cudart()
            error = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
            if int(error) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.1f} GiB failed "
                                   f"({error}): not enough host memory to page-lock")
            weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        self.free.append(buffer)


class _Stored:
    """One offloaded input: its CPU copy, the event its copy out recorded, its fetch if started."""

    def __init__(self, buffer: torch.Tensor, cpu: torch.Tensor, shape: torch.Size,
                 dtype: torch.dtype, copied: Any):
        self.buffer, self.cpu, self.shape, self.dtype = buffer, cpu, shape, dtype
        self.copied = copied
        self.fetched: torch.Tensor | None = None
        self.arrived: Any = None


class HostOffloader:
    """Moves block inputs to CPU memory in forward and back in backward, off the compute stream.

    Copies out wait for the compute stream to have produced the tensor; the tensor's GPU memory is
    reused only after the copy (record_stream). Fetches start one block ahead of backward's need.
    On a CPU device the same steps run as plain copies (tests take the path a GPU run takes).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.buffers = HostBuffers(pin=self.cuda)
        self.out_stream = torch.cuda.Stream(device) if self.cuda else None
        self.in_stream = torch.cuda.Stream(device) if self.cuda else None
        self.live: list[_Stored] = []  # in forward order: backward fetches the one before

    def store(self, tensor: torch.Tensor) -> _Stored:
        nbytes = tensor.numel() * tensor.element_size()
        buffer = self.buffers.take(nbytes)
        cpu = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        copied = None
        if self.cuda:
            self.out_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.out_stream):
                cpu.copy_(tensor, non_blocking=True)
                copied = self.out_stream.record_event()
            tensor.record_stream(self.out_stream)
        else:
            cpu.copy_(tensor)
        stored = _Stored(buffer, cpu, tensor.shape, tensor.dtype, copied)
        self.live.append(stored)
        return stored

    def _start_fetch(self, stored: _Stored) -> None:
        if stored.fetched is not None:
            return
        if not self.cuda:
            stored.fetched = stored.cpu.clone()
            return
        self.in_stream.wait_event(stored.copied)
        with torch.cuda.stream(self.in_stream):
            gpu = torch.empty(stored.shape, dtype=stored.dtype, device=self.device)
            gpu.copy_(stored.cpu, non_blocking=True)
            stored.arrived = self.in_stream.record_event()
        stored.fetched = gpu

    def forget(self, stored: _Stored) -> None:
        """A stored input whose backward will never come: its buffer back, if still held."""
        if any(entry is stored for entry in self.live):
            self.live.remove(stored)
            self.buffers.give_back(stored.buffer)

    def fetch(self, stored: _Stored) -> torch.Tensor:
        """The input on the GPU again; starts fetching the input stored before it."""
        self._start_fetch(stored)
        index = self.live.index(stored)
        if index > 0:
            self._start_fetch(self.live[index - 1])
        self.live.pop(index)
        gpu = stored.fetched
        assert gpu is not None
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(stored.arrived)
            gpu.record_stream(current)
        # Its buffer is written next only by a copy out that waits for the compute stream,
        # which has waited for this copy in.
        self.buffers.give_back(stored.buffer)
        stored.fetched = None
        return gpu


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, run: _BlockRun, args: tuple[Any, ...],
                kwargs: dict[str, Any], *trained: torch.Tensor) -> torch.Tensor:
        # `trained`: the block's parameters that train, inputs so that the output needs a
        # gradient when only they do (LoRA: the hidden states come from a frozen embedding);
        # backward accumulates their gradients itself, as a reentrant checkpoint does.
        ctx.run, ctx.args, ctx.kwargs = run, args, kwargs
        ctx.rng = _rng_state(hidden.device)
        out = run.forward(hidden, *args, **kwargs)
        ctx.stored = run.offloader.store(hidden)
        # A graph freed without its backward (an error, a loss not backpropagated) gives the
        # buffer back: nothing piles up in page-locked memory.
        weakref.finalize(ctx, run.offloader.forget, ctx.stored)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        run: _BlockRun = ctx.run
        hidden = run.offloader.fetch(ctx.stored).requires_grad_(True)
        with torch.random.fork_rng(devices=_rng_devices(hidden.device)):
            _set_rng_state(ctx.rng, hidden.device)
            with torch.enable_grad(), recomputing():
                out = run.forward(hidden, *ctx.args, **ctx.kwargs)
        torch.autograd.backward(out, grad_out)
        ctx.run = ctx.args = ctx.kwargs = ctx.stored = None
        grad = hidden.grad if ctx.needs_input_grad[0] else None
        return (grad, None, None, None, *(None for _ in ctx.needs_input_grad[4:]))


def _rng_devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device
                   ) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class _BlockRun:
    """A block's own forward (its class's, bound to it: FSDP's hooks run around the block's
    call, not in here) and the offloader its input goes to."""

    def __init__(self, block: torch.nn.Module, offloader: HostOffloader):
        self.block = weakref.ref(block)
        self.forward, self.offloader = _own_forward(block), offloader

    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The block's forward from now on: checkpointed whole, its input kept in CPU memory
        until backward. Other inputs (position embeddings, masks) stay where they are: the same
        tensors for every block, needing no gradient. Without gradients (evaluation) the block
        just runs."""
        if not torch.is_grad_enabled():
            return self.forward(hidden, *args, **kwargs)
        if kwargs.get("past_key_values") is not None:
            # the recompute would append this block's keys and values to the cache again
            raise ValueError("an offloaded block runs without a KV cache: call the model with "
                             "use_cache=False")
        if any(isinstance(v, torch.Tensor) and v.requires_grad
               for v in (*args, *kwargs.values())):
            raise ValueError("an offloaded block's inputs other than the hidden states must not "
                             "need gradients")
        block = self.block()
        trained = [] if block is None else [p for p in block.parameters() if p.requires_grad]
        return _OffloadedCheckpoint.apply(hidden, self, args, kwargs, *trained)


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tiles: _Tiles, *params: torch.Tensor) -> torch.Tensor:
        ctx.tiles = tiles
        ctx.save_for_backward(x)
        if _recomputing() and tiles.output_unread:
            return torch.empty_like(x)  # backward alone reads this MLP (the module doc)
        return tiles.run(x)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        tiles: _Tiles = ctx.tiles
        params = tiles.trained()
        rows = x.reshape(-1, x.shape[-1])
        grads_out = grad_out.reshape(-1, grad_out.shape[-1])
        grad_rows = torch.empty_like(rows)
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        for part in tiles.slices(rows.shape[0]):
            piece = rows[part].detach().requires_grad_(True)
            with torch.enable_grad():
                y = tiles.compute(piece)
            grads = torch.autograd.grad(y, [piece, *params], grads_out[part], allow_unused=True)
            grad_rows[part] = grads[0]
            for i, g in enumerate(grads[1:]):  # summed in fp32, rounded once, as one GEMM
                if g is not None:
                    param_grads[i] = g.float() if param_grads[i] is None else param_grads[i] + g
        ctx.tiles = None
        return (grad_rows.view_as(x), None,
                *(g if g is None else g.to(p.dtype) for g, p in zip(param_grads, params)))


class _Tiles:
    """An MLP's forward run over slices of at most `tile_tokens` tokens, keeping only its input
    (the module doc); `compute` is the MLP's own forward (compiled, or not)."""

    def __init__(self, mlp: torch.nn.Module, compute: Any, tile_tokens: int,
                 output_unread: bool, min_tile_tokens: int = 1):
        self.mlp = weakref.ref(mlp)
        self.compute, self.tile_tokens, self.output_unread = compute, tile_tokens, output_unread
        self.min_tile_tokens = min_tile_tokens

    def slices(self, rows: int) -> list[slice]:
        tiles = mlp_tiles(rows, self.tile_tokens, self.min_tile_tokens)
        size = -(-rows // tiles)
        return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]

    def trained(self) -> list[torch.Tensor]:
        mlp = self.mlp()
        return [] if mlp is None else [p for p in mlp.parameters() if p.requires_grad]

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP slice by slice, nothing kept for backward."""
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(rows)
        for part in self.slices(rows.shape[0]):
            out[part] = self.compute(rows[part])
        return out.view_as(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Without gradients (a checkpoint's forward, evaluation) still in slices: a whole
        # sequence's MLP-wide tensors are what the tiles keep off the GPU.
        if not torch.is_grad_enabled():
            return self.run(x)
        return _TiledMLP.apply(x, self, *self.trained())


def _own_forward(module: torch.nn.Module) -> Any:
    """The module's class's forward bound to it (what its call ran before we replaced it)."""
    return type(module).forward.__get__(module)


def offload_blocks(blocks: torch.nn.ModuleList, device: torch.device, *, tile_tokens: int,
                   output_unread: bool, compile_backend: str | None = None,
                   min_tile_tokens: int = 1) -> HostOffloader:
    """Each block checkpointed whole with its input in CPU memory, its MLP tiled (the module
    doc), sharing one offloader. The forwards are replaced on the instances: parameter names,
    checkpoints and FSDP's wrapping see the same modules as before.

    compile_backend: torch.compile each module of each block (norms, attention, the MLP's
    forward) in place; the checkpoint and tiles around them stay Python."""
    offloader = HostOffloader(device)
    for block in blocks:
        mlp = block.mlp
        compute = _own_forward(mlp)
        if compile_backend:
            compute = torch.compile(compute, backend=compile_backend)
            for name, child in block.named_children():
                if name != "mlp":
                    child.compile(backend=compile_backend)
        mlp.forward = _Tiles(mlp, compute, tile_tokens, output_unread, min_tile_tokens)
        block.forward = _BlockRun(block, offloader)
    return offloader
