"""A training batch and the label value that carries no loss (no `datasets` import: the
benchmark and the parallelism code use these without the data pipeline)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # (batch, length), right-padded
    labels: torch.Tensor  # same shape; IGNORE_INDEX where no loss is taken
    num_tokens: int  # tokens that are not padding
    position_ids: torch.Tensor | None = None  # packed rows: restart at 0 for every example
    # DPO with dpo_reference precompute: each row's reference log-probability, from a first pass.
    reference_logps: torch.Tensor | None = None

    # Packed rows under a varlen kernel: packed_documents of position_ids found on the host by
    # `to(device, varlen=True)` (no device sync), with the positions they were found for.
    documents: tuple[torch.Tensor, dict[str, Any]] | None = None

    def to(self, device: torch.device, varlen: bool = False) -> Batch:
        positions = None if self.position_ids is None else self.position_ids.to(device)
        reference = None if self.reference_logps is None else self.reference_logps.to(device)
        documents = None
        if varlen and positions is not None:
            found = packed_documents(self.position_ids)
            documents = (positions, {key: value.to(device) if isinstance(value, torch.Tensor)
                                     else value for key, value in found.items()})
        return Batch(self.input_ids.to(device), self.labels.to(device), self.num_tokens, positions,
                     reference, documents)

    def model_inputs(self, varlen: bool = False) -> dict[str, Any]:
        """The model's keyword arguments for this batch.

        From position_ids that restart, transformers builds the block-diagonal causal mask (sdpa,
        eager, flex), so no token attends to another packed example; it does so only without a
        KV cache: call the model with use_cache=False. `varlen` (fa4, trainer/attention.py):
        the documents' boundaries instead (`packed_documents`), and no mask.
        """
        inputs: dict[str, Any] = {"input_ids": self.input_ids}
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
            if varlen:
                found = self.documents  # unless position_ids changed since (dataclasses.replace)
                inputs.update(found[1] if found is not None and found[0] is self.position_ids
                              else packed_documents(self.position_ids))
        return inputs


def packed_documents(position_ids: torch.Tensor) -> dict[str, Any]:
    """Varlen attention's arguments for packed rows (transformers' FlashAttentionKwargs): each
    document starts where its positions restart at 0 (a row's padding, whose positions restart
    too, is a document of its own, attended by nothing else), bounded in the rows' tokens taken
    as one sequence; the longest bounded by the row length (bounding it by the longest document
    in whole 128-token tiles, 128 for documents of up to 17 tokens, left the kernels' time as it
    was on an H100: the empty tiles exit at once). An all-true attention mask, so that
    transformers builds no block-diagonal one (whose size is the row length squared)."""
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().flatten()
    end = torch.tensor([flat.numel()], device=flat.device)
    bounds = torch.cat([starts, end]).to(torch.int32)
    length = position_ids.shape[-1]
    return {"attention_mask": torch.ones_like(position_ids, dtype=torch.bool),
            "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds,
            "max_length_q": length, "max_length_k": length}
