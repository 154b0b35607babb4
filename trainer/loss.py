"""The LM loss without the whole logits tensor: the head's matmul and cross entropy in chunks.

With a 128k vocabulary the fp32 logits of one micro batch are the largest tensor of a step (8k
tokens: 4 GB, and plain autograd keeps several copies). Here the head and the loss run over chunks
of tokens; the forward also computes the gradients of each chunk, so no logits outlive their chunk
and the backward only scales the stored gradients by grad_output.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from finetune_contract.families import family_of, softcap
from finetune_contract.throughput import LOGITS_PER_CHUNK

LOSS_METHOD = "causal_lm_loss_sum"
ROW_LOSS_METHOD = "causal_lm_row_loss_sums"  # per sequence: DPO's log-probabilities


def capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The logits soft-capped as the model's head does (Gemma 2/3: cap x tanh(logits / cap))."""
    return logits if not cap else cap * torch.tanh(logits / cap)


def _chunk_loss(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, cap: float | None = None
) -> torch.Tensor:
    """Summed cross entropy of one chunk, in fp32."""
    logits = capped(logits.float(), cap)
    valid = labels != ignore_index
    target = logits.gather(1, labels.masked_fill(~valid, 0)[:, None]).squeeze(1)
    return ((torch.logsumexp(logits, dim=-1) - target) * valid).sum()


def _chunk_loss_and_grad(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, cap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, its gradient w.r.t. the logits in their dtype), computed in fp32.

    Written as one reduction and pointwise ops (a one-hot by comparison, not a scatter) so that
    torch.compile fuses it into a pass or two over the chunk.
    """
    logits32 = logits.float()
    tanh = torch.tanh(logits32 / cap) if cap else None
    if tanh is not None:
        logits32 = cap * tanh
    valid = labels != ignore_index
    target = labels.masked_fill(~valid, 0)
    lse = torch.logsumexp(logits32, dim=-1)
    loss = ((lse - logits32.gather(1, target[:, None]).squeeze(1)) * valid).sum()
    classes = torch.arange(logits.shape[1], device=logits.device)
    one_hot = classes[None, :] == target[:, None]
    grad = (torch.exp(logits32 - lse[:, None]) - one_hot.float()) * valid[:, None]
    if tanh is not None:
        grad = grad * (1 - tanh * tanh)  # through the cap
    return loss, grad.to(logits.dtype)


@functools.cache
def _compiled(fn: Any) -> Any:
    # Eager it takes ~10 passes over the chunk; compiled one reduction and one pointwise pass.
    return torch.compile(fn, dynamic=True)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int,
        chunk_tokens: int,
        cap: float | None,
    ) -> torch.Tensor:
        # Only the gradients backward will ask for: a frozen head (LoRA, QLoRA) gets none, which
        # saves its GEMM and a head-sized buffer (8B: 1 GiB).
        hidden_grad, weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss_and_grad, loss_only = _chunk_loss_and_grad, _chunk_loss
        if hidden.is_cuda:
            loss_and_grad, loss_only = _compiled(loss_and_grad), _compiled(loss_only)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if hidden_grad else None
        grad_weight = torch.zeros_like(weight) if weight_grad else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            h, y = hidden[start : start + chunk_tokens], labels[start : start + chunk_tokens]
            logits = h @ weight.T
            if grad_hidden is None and grad_weight is None:
                loss += loss_only(logits, y, ignore_index, cap)
                continue
            chunk_loss, grad_logits = loss_and_grad(logits, y, ignore_index, cap)
            del logits
            loss += chunk_loss
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[start : start + chunk_tokens])
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.T, h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        # In place: the stored gradients are used once (no double backward).
        grads = [None if g is None else g.mul_(grad_loss.to(g.dtype))
                 for g in (grad_hidden, grad_weight)]
        return grads[0], grads[1], None, None, None, None


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    cap: float | None = None,
) -> torch.Tensor:
    """sum(cross_entropy(capped(hidden @ weight.T), labels)) over labels != ignore_index, fp32.

    hidden: (tokens, hidden), weight: (vocab, hidden), labels: (tokens,). Equal to the plain
    loss (logits upcast to fp32) within rounding, without ever holding more than `chunk_tokens`
    rows of logits. cap: the model's final logit soft cap (None: none).
    """
    if chunk_tokens is None:
        chunk_tokens = max(1, LOGITS_PER_CHUNK // weight.shape[0])
    if not torch.is_grad_enabled():  # the Function's needs_input_grad ignores the grad mode
        hidden, weight = hidden.detach(), weight.detach()
    result = _LinearCrossEntropy.apply(
        hidden.contiguous(), weight, labels.contiguous(), ignore_index, chunk_tokens, cap
    )
    return result  # type: ignore[no-any-return]


def causal_lm_loss_sum(
    model: torch.nn.Module,
    labels: torch.Tensor,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    **inputs: Any,
) -> torch.Tensor:
    """Summed cross entropy of every labelled next-token prediction of a Hugging Face causal LM.

    `inputs` go to the decoder (`model.model`); the head is applied here, chunked. With tensor
    and sequence parallelism each rank runs the chunked loss on its part of the sequence
    (`_sequence_parallel_loss_sum`); another DTensor head keeps its own module, which gathers
    whole logits.
    """
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    weight, cap = head.weight, final_softcap(model)
    if (isinstance(weight, DTensor) and isinstance(hidden, DTensor)
            and weight.placements in ((Shard(0),), (Replicate(),))
            and hidden.placements == (Shard(1),) and getattr(head, "bias", None) is None):
        return _sequence_parallel_loss_sum(hidden, weight, labels, ignore_index, chunk_tokens,
                                           cap)
    labels = labels[:, 1:].flatten()
    if isinstance(weight, DTensor) or getattr(head, "bias", None) is not None:
        logits = capped(head(hidden)[:, :-1].flatten(0, 1).float(), cap)
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    hidden = hidden[:, :-1].flatten(0, 1)
    return linear_cross_entropy_sum(hidden, head.weight, labels, ignore_index, chunk_tokens, cap)


def final_softcap(model: torch.nn.Module) -> float | None:
    """The model's final logit soft cap (its family's config key), None without one."""
    config = getattr(model, "config", None)
    return None if config is None else softcap(config, family_of(config).final_softcap_key)


def causal_lm_row_loss_sums(
    model: torch.nn.Module,
    labels: torch.Tensor,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    **inputs: Any,
) -> torch.Tensor:
    """(batch,) summed cross entropy of each row's labelled next-token predictions: minus the
    log-probability of its response. The head runs chunked, row by row."""
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    head, cap = model.get_output_embeddings(), final_softcap(model)
    if isinstance(head.weight, DTensor) or getattr(head, "bias", None) is not None:
        logits = capped(head(hidden)[:, :-1].float(), cap)
        losses = F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=ignore_index,
                                 reduction="none")
        return losses.sum(dim=1)
    return torch.stack([
        linear_cross_entropy_sum(hidden[row, :-1], head.weight, labels[row, 1:], ignore_index,
                                 chunk_tokens, cap)
        for row in range(hidden.shape[0])
    ])


def _sequence_parallel_loss_sum(
    hidden: DTensor,
    weight: DTensor,
    labels: torch.Tensor,
    ignore_index: int,
    chunk_tokens: int | None,
    cap: float | None = None,
) -> torch.Tensor:
    """The loss of a tensor-parallel model without whole logits on any rank.

    hidden: sharded over the sequence (sequence parallelism); weight: sharded over the vocabulary
    or replicated. Each rank takes the whole weight, its gradient marked partial (the backward
    sums the ranks' gradients: a reduce-scatter, or an all-reduce), and runs the chunked loss on
    its own positions, whose targets are the next tokens of the whole sequence. The value is
    the TP group's total; the gradient is this rank's part, which with the other ranks' parts
    makes the total's.
    """
    mesh = weight.device_mesh
    group, rank = mesh.get_group(), mesh.get_local_rank()
    local = hidden.to_local()  # (batch, seq / tp, hidden)
    length = local.shape[1]
    # The target of every position of the sequence; the last one has none.
    targets = F.pad(labels[:, 1:], (0, 1), value=ignore_index)
    local_targets = targets[:, rank * length : (rank + 1) * length].flatten()
    full_weight = weight.redistribute(placements=[Replicate()]).to_local(
        grad_placements=[Partial()]
    )
    part = linear_cross_entropy_sum(
        local.flatten(0, 1), full_weight, local_targets, ignore_index, chunk_tokens, cap
    )
    total = part.detach().clone()
    dist.all_reduce(total, group=group)
    return part + (total - part.detach())


def add_loss_method(model: torch.nn.Module, chunk_tokens: int | None = None) -> None:
    """Give `model` a `causal_lm_loss_sum(labels, ignore_index, **inputs)` method, its head in
    chunks of `chunk_tokens` (None: LOGITS_PER_CHUNK's; the trainer passes the run's,
    rules.loss_chunk_tokens).

    It reads the head's weight outside the head's forward, so FSDP must treat the method as a
    forward of the root (gather the root's parameters before, hook its backward after) as it
    does for `model(...)`; a model that is not FSDP-sharded gets the plain method.
    """
    for name, method in ((LOSS_METHOD, causal_lm_loss_sum),
                         (ROW_LOSS_METHOD, causal_lm_row_loss_sums)):
        setattr(model, name, functools.partial(method, model, chunk_tokens=chunk_tokens))
        register_fsdp_forward_method(model, name)
