"""The attention kernel of the decoder blocks: cuDNN through sdpa, or FlashAttention 4 (`fa4`).

`attention: fa4` runs the CuTe-DSL FlashAttention 4 kernels (package `flash-attn-4`, forward and
backward for Hopper sm_90 and Blackwell sm_100) as two torch custom ops, `trainer::fa4_fwd` and
`trainer::fa4_bwd`, tied together by `torch.library.register_autograd`: `torch.compile` sees
them as opaque calls with known output shapes, so the compiled blocks keep them as they are.

The attention function registered with transformers (ATTN_IMPLEMENTATION) calls them for what
the kernels compute, causal self-attention over whole rows (no mask, as many queries as keys,
bf16 or fp16, a head dim the kernels take), and for packed rows their varlen form: the batch's
tokens as one sequence of documents whose bounds (`cu_seq_lens_q`, from the positions that
restart: `trainer.batch.packed_documents`) keep each document's attention to itself, with no
mask made. Anything else goes to transformers' sdpa function with the mask sdpa would get: a
padded batch, generation with a KV cache, sliding windows, soft-capping (packed rows on a model
with those are refused by the contract, `finetune_contract.rules`).

Where the tensors are not on a CUDA device (the tests) the ops run a plain torch reference of
the same function (fp32 softmax, the kernels' log-sum-exp and backward formulas), so the
op registration, the autograd wiring and compile are tested on the CPU; the kernels themselves
are checked against cuDNN on the GPU (`python -m bench.train --attention-check`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from finetune_contract.fields import FA4_HEAD_DIMS

# The name under which transformers finds the fa4 attention function (config._attn_implementation).
ATTN_IMPLEMENTATION = "trainer_fa4"
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def runs_varlen(model: torch.nn.Module) -> bool:
    """Whether packed rows reach this model's attention as documents (fa4) rather than a mask."""
    return getattr(model.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION


def attn_implementation(attention: str) -> str:
    """The transformers attn_implementation of the contract's `attention` value."""
    if attention == "fa4":
        register()
        return ATTN_IMPLEMENTATION
    return "sdpa"


@functools.cache
def _kernels() -> Any:
    """flash_attn.cute's interface module (imported on first use: it loads CUTLASS's DSL)."""
    from flash_attn.cute import interface

    return interface


def _reference_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      causal: bool, cu_seqlens: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, ...]:
    """(q, k, v with KV heads repeated per group, masked scores) in fp32, (batch, heads, seq, .).
    cu_seqlens: the documents' boundaries in one row of packed tokens (the varlen layout, as a
    batch of one); a token attends only within its document."""
    groups = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(groups, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(groups, dim=1)
    scores = qf @ kf.transpose(-1, -2) * scale
    keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device)
    if causal:
        keep = keep.tril()
    if cu_seqlens is not None:
        document = document_index(cu_seqlens, q.shape[1])
        keep = keep & (document[:, None] == document[None, :])
    scores = scores.masked_fill(~keep, float("-inf"))
    return qf, kf, vf, scores


def document_index(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each packed token's document index, from the documents' boundaries."""
    starts = torch.zeros(total, dtype=torch.long, device=cu_seqlens.device)
    starts[cu_seqlens[1:-1].long()] = 1
    return starts.cumsum(0)


def _reference_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   causal: bool, cu_seqlens: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of softmax(q k^T * scale) v in fp32; layouts (batch, seq, heads, dim)."""
    qf, _, vf, scores = _reference_scores(q, k, v, scale, causal, cu_seqlens)
    lse = torch.logsumexp(scores, dim=-1)  # (batch, heads, seq)
    out = (torch.exp(scores - lse.unsqueeze(-1)) @ vf).transpose(1, 2)
    return out.to(q.dtype).contiguous(), lse.contiguous()


def _reference_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, scale: float,
                   causal: bool, cu_seqlens: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention's backward from the saved out and lse, in fp32 (GQA: summed per KV head)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    groups = heads // kv_heads
    of, dof = (t.float().transpose(1, 2) for t in (out, dout))
    qf, kf, vf, scores = _reference_scores(q, k, v, scale, causal, cu_seqlens)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    dv = probs.transpose(-1, -2) @ dof
    dprobs = dof @ vf.transpose(-1, -2)
    delta = (dof * of).sum(-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq = dscores @ kf
    dk = dscores.transpose(-1, -2) @ qf

    def per_kv_head(grad: torch.Tensor) -> torch.Tensor:
        b, _, s, d = grad.shape
        return grad.view(b, kv_heads, groups, s, d).sum(2)

    dk, dv = per_kv_head(dk), per_kv_head(dv)
    return tuple(t.transpose(1, 2).to(q.dtype).contiguous() for t in (dq, dk, dv))  # type: ignore[return-value]


# Varlen (packed rows): q, k, v of all rows' tokens in one (total, heads, dim), documents
# bounded by cu_seqlens (int32, documents + 1), max_seqlen their longest (or a bound on it);
# lse (heads, total). Without: (batch, seq, heads, dim) and lse (batch, heads, seq).


def _reference_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          causal: bool, cu_seqlens: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _reference_fwd(q[None], k[None], v[None], scale, causal, cu_seqlens)
    return out[0], lse[0]


@torch.library.custom_op("trainer::fa4_fwd", mutates_args=())
def fa4_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
            cu_seqlens: torch.Tensor | None = None,
            max_seqlen: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): out like q (its layout above), lse fp32."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if q.device.type != "cuda":
        if cu_seqlens is not None:
            return _reference_varlen_fwd(q, k, v, scale, causal, cu_seqlens)
        return _reference_fwd(q, k, v, scale, causal)
    varlen = {} if cu_seqlens is None else {
        "cu_seqlens_q": cu_seqlens, "cu_seqlens_k": cu_seqlens, "max_seqlen_q": max_seqlen,
        "max_seqlen_k": max_seqlen}
    result = _kernels()._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal,
                                        return_lse=True, **varlen)
    return result[0], result[1]


@fa4_fwd.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
      cu_seqlens: torch.Tensor | None = None,
      max_seqlen: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    if cu_seqlens is not None:
        total, heads, _ = q.shape
        return out, q.new_empty(heads, total, dtype=torch.float32)
    batch, seq, heads, _ = q.shape
    return out, q.new_empty(batch, heads, seq, dtype=torch.float32)


@torch.library.custom_op("trainer::fa4_bwd", mutates_args=())
def fa4_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool,
            cu_seqlens: torch.Tensor | None = None,
            max_seqlen: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dout = dout.contiguous()
    if q.device.type != "cuda":
        if cu_seqlens is not None:
            grads = _reference_bwd(dout[None], q[None], k[None], v[None], out[None], lse[None],
                                   scale, causal, cu_seqlens)
            return grads[0][0], grads[1][0], grads[2][0]
        return _reference_bwd(dout, q, k, v, out, lse, scale, causal)
    varlen = {} if cu_seqlens is None else {
        "cu_seqlens_q": cu_seqlens, "cu_seqlens_k": cu_seqlens, "max_seqlen_q": max_seqlen,
        "max_seqlen_k": max_seqlen}
    dq, dk, dv = _kernels()._flash_attn_bwd(q, k, v, out, dout, lse, scale, causal,
                                            **backward_order(), **varlen)[:3]
    return dq, dk, dv


@fa4_bwd.register_fake
def _(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
      lse: torch.Tensor, scale: float, causal: bool, cu_seqlens: torch.Tensor | None = None,
      max_seqlen: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def backward_order() -> dict[str, bool]:
    """The kernel's backward adds with atomics, in no fixed order: dq over key blocks, and with
    grouped-query heads each KV head's dk and dv over its query heads. Under
    torch.use_deterministic_algorithms it orders those sums with semaphores instead (bitwise
    repeatable, 15-41% slower backward: docs/trainer.md)."""
    return {"deterministic": torch.are_deterministic_algorithms_enabled()}


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    q, k, v, scale, causal, cu_seqlens, max_seqlen = inputs
    out, lse = output
    ctx.save_for_backward(q.contiguous(), k.contiguous(), v.contiguous(), out, lse, cu_seqlens)
    ctx.scale, ctx.causal, ctx.max_seqlen = scale, causal, max_seqlen


def _backward(ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None) -> tuple[Any, ...]:
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = fa4_bwd(dout, q, k, v, out, lse, ctx.scale, ctx.causal, cu_seqlens,
                         ctx.max_seqlen)
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd("trainer::fa4_fwd", _backward, setup_context=_setup_context)


def kernel_takes(query: torch.Tensor, key: torch.Tensor, attention_mask: Any, dropout: float,
                 kwargs: dict[str, Any]) -> bool:
    """Whether the fa4 kernels compute this call (else sdpa does): plain causal self-attention."""
    return (
        attention_mask is None
        and not dropout
        and query.shape[2] == key.shape[2]
        and query.dtype in _KERNEL_DTYPES
        and query.shape[-1] in FA4_HEAD_DIMS
        and not kwargs.get("sliding_window")
        and not kwargs.get("softcap")
        and kwargs.get("is_causal", True) is not False
    )


def fa4_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: torch.Tensor | None,
                          dropout: float = 0.0, scaling: float | None = None,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q, k, v (batch, heads, seq, dim); the output
    (batch, seq, heads, dim), as sdpa_attention_forward returns it."""
    if not getattr(module, "is_causal", True) or not kernel_takes(
            query, key, attention_mask, dropout, kwargs):
        if kwargs.get("cu_seq_lens_q") is not None:  # the rules refuse these first
            raise ValueError("packed rows with fa4 need its varlen kernel, which this layer "
                             "does not take (a sliding window, soft cap or mask): use sdpa")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else 1 / math.sqrt(query.shape[-1])
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is not None:  # packed rows (trainer.batch.Batch.model_inputs): varlen
        batch, heads, seq, _ = query.shape
        q, k, v = (t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[-1])
                   for t in (query, key, value))
        out, _ = fa4_fwd(q, k, v, float(scale), True, cu_seqlens, int(kwargs["max_length_q"]))
        return out.view(batch, seq, heads, -1), None
    out, _ = fa4_fwd(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                     float(scale), True)
    return out, None


@functools.cache
def register() -> None:
    """The fa4 attention function and its mask function (sdpa's) under ATTN_IMPLEMENTATION."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, fa4_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


def fa4_device_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA capability the fa4 rule checks (None: no CUDA device)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None
