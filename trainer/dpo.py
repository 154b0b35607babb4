"""Direct preference optimisation: the loss on (chosen, rejected) pairs and its reward metrics.

A DPO batch holds the chosen responses in its first half and the rejected ones, of the same
prompts in the same order, in its second (as TRL builds it). A response's log-probability is the
sum over its labelled tokens; the reward of a response is beta times its policy-minus-reference
log-ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from finetune_contract.data import IGNORE_INDEX
from trainer.batch import Batch
from trainer.loss import ROW_LOSS_METHOD


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
