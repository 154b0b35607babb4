"""Direct preference optimisation: the loss on (chosen, rejected) pairs and its reward metrics.

A DPO batch holds the chosen responses in its first half and the rejected ones, of the same
prompts in the same order, in its second (as TRL builds it). A response's log-probability is the
sum over its labelled tokens; the reward of a response is beta times its policy-minus-reference
log-ratio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import datasets
import torch
import torch.distributed as dist
import torch.nn.functional as F

from finetune_contract.data import IGNORE_INDEX
from finetune_contract.fields import DPO_METRICS
from trainer.batch import Batch
from trainer.config import TrainConfig
from trainer.lora import adapters_disabled
from trainer.loss import ROW_LOSS_METHOD
from trainer.master_weights import compute_weights


@dataclass
class PairScores:
    """Per pair: the loss, the rewards (detached) of both responses."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def sequence_logps(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """(rows,) log-probability of each row's labelled tokens under `model`."""
    row_loss_sums = getattr(model, ROW_LOSS_METHOD)  # the chunked head of trainer.loss
    return -row_loss_sums(batch.labels, IGNORE_INDEX, **batch.model_inputs())


def response_tokens(batch: Batch) -> torch.Tensor:
    """(rows,) labelled tokens of each row: the response, its end token included."""
    return (batch.labels[:, 1:] != IGNORE_INDEX).sum(dim=1)


def dpo_scores(policy_logps: torch.Tensor, reference_logps: torch.Tensor, tokens: torch.Tensor,
               *, beta: float, loss: str = "sigmoid", label_smoothing: float = 0.0
               ) -> PairScores:
    """DPO's per-pair loss from the rows' log-probabilities (chosen half, then rejected half).

    sigmoid: -log sigmoid(beta * margin), with label smoothing e the conservative form
    -(1 - e) log sigmoid(beta * margin) - e log sigmoid(-beta * margin) (Mitchell's cDPO);
    ipo: (margin of the per-token averaged log-ratios - 1 / (2 beta))^2 (Azar et al., eq. 17,
    averaged per token as TRL does).
    """
    logratios = policy_logps - reference_logps
    chosen, rejected = logratios.chunk(2)
    if loss == "ipo":
        chosen_tokens, rejected_tokens = tokens.chunk(2)
        margin = chosen / chosen_tokens.clamp(min=1) - rejected / rejected_tokens.clamp(min=1)
        losses = (margin - 1 / (2 * beta)) ** 2
    else:
        margin = beta * (chosen - rejected)
        losses = -(1 - label_smoothing) * F.logsigmoid(margin) \
            - label_smoothing * F.logsigmoid(-margin)
    return PairScores(losses, beta * chosen.detach(), beta * rejected.detach())


def reference_logps(reference: torch.nn.Module | None, model: torch.nn.Module,
                    batch: Batch) -> torch.Tensor:
    """The rows' log-probabilities under the reference: the frozen copy, or (LoRA, None) the
    policy itself with its adapters disabled."""
    with torch.no_grad():
        if reference is not None:
            return sequence_logps(reference, batch)
        with adapters_disabled(model):
            return sequence_logps(model, batch)


def dpo_train_step(model: torch.nn.Module, reference: torch.nn.Module | None,
                   micro_batches: list[Batch], config: TrainConfig, env: Any,
                   scaler: torch.amp.GradScaler | None = None
                   ) -> tuple[float, int, dict[str, float]]:
    """Forward and backward over micro batches of pairs; returns (mean loss per pair, global
    tokens, the step's mean rewards, reward accuracy and margin over every rank's pairs).

    Every pair weighs the same whatever its micro batch or rank (TRL: the mean over pairs); FSDP
    averages gradients over ranks, hence the factor world_size.
    """
    counts = torch.tensor([sum(b.input_ids.shape[0] // 2 for b in micro_batches),
                           sum(b.num_tokens for b in micro_batches)],
                          dtype=torch.float64, device=env.device)
    dist.all_reduce(counts)
    pairs, tokens = counts.tolist()
    # loss, chosen rewards, rejected rewards, correct pairs, margins: sums over pairs.
    sums = torch.zeros(5, dtype=torch.float64, device=env.device)
    for batch in micro_batches:
        batch = batch.to(env.device)
        with compute_weights(model):
            ref = batch.reference_logps if batch.reference_logps is not None \
                else reference_logps(reference, model, batch)
            scores = dpo_scores(sequence_logps(model, batch), ref, response_tokens(batch),
                                beta=config.dpo_beta, loss=config.dpo_loss,
                                label_smoothing=config.dpo_label_smoothing)
            loss = scores.losses.sum()
            scaled = loss * env.world_size / pairs
            (scaler.scale(scaled) if scaler else scaled).backward()
        chosen, rejected = scores.chosen_rewards, scores.rejected_rewards
        sums += torch.stack([loss.detach(), chosen.sum(), rejected.sum(),
                             (chosen > rejected).sum(), (chosen - rejected).sum()]).double()
    dist.all_reduce(sums)
    means = (sums / pairs).tolist()
    return means[0], int(tokens), dict(zip(DPO_METRICS, means[1:], strict=True))


def with_reference_logps(train: datasets.Dataset, model: torch.nn.Module, micro_batch: int,
                         env: Any, pad_id: int) -> datasets.Dataset:
    """The train pairs with their reference log-probabilities, from one pass of the initial
    `model` (LoRA: its adapters disabled); each rank scores its share, all ranks get all."""
    from trainer.data import REFERENCE_LOGPS, EvalBatches

    batches = EvalBatches(train, micro_batch, env.rank, env.world_size, pad_id)
    mine: list[float] = []
    model.eval()
    with compute_weights(model):
        for batch in batches:  # every rank runs as many forwards: each one is a collective
            logps = reference_logps(None, model, batch.to(env.device))
            mine += logps.double().cpu().tolist()
    model.train()
    shares: list[list[float]] = [[] for _ in range(env.world_size)]
    dist.all_gather_object(shares, mine)
    by_row: dict[int, list[float]] = {}
    for rank, logps in enumerate(shares):
        # A batch of n pairs gave n chosen then n rejected log-probabilities, in row order.
        rows = list(range(rank, len(train), env.world_size))
        offset = 0
        for start in range(0, len(rows), micro_batch):
            chunk = rows[start : start + micro_batch]
            n = len(chunk)
            for i, row in enumerate(chunk):
                by_row[row] = [logps[offset + i], logps[offset + n + i]]
            offset += 2 * n
    return train.add_column(REFERENCE_LOGPS, [by_row[row] for row in range(len(train))])
