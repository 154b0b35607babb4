"""compile=true (torch.compile per decoder block) trains to the same losses as compile=false.

On CPU the blocks compile with the aot_eager backend: the same Dynamo graphs and AOT autograd as
inductor, without inductor's C++ code generation (minutes for a tiny model on a CPU). GPU runs of
bench.train use inductor and print their losses.
"""

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from trainer.config import load_config
from trainer.loss import LOSS_METHOD, add_loss_method
from trainer.model import build_model, materialize_weights
from trainer.optim import build_optimizer, clip_grad_norm
from trainer.parallel import apply_parallelism


def train_losses(env, steps: int = 3, **overrides) -> tuple[list[float], set[str]]:
    config = load_config(None, {"lr": 1e-2, "seed": 3, **overrides})
    model = build_model(config.model)
    apply_parallelism(model, config, env)
    materialize_weights(model, config.model, config.seed, env.device)
    add_loss_method(model)
    optimizer = build_optimizer(model, config, env.device)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=generator)
    losses = []
    for _ in range(steps):  # on one batch, which the model learns
        loss = getattr(model, LOSS_METHOD)(input_ids, input_ids=input_ids) / input_ids.numel()
        loss.backward()
        clip_grad_norm(model, config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, set(get_model_state_dict(model))


@pytest.mark.parametrize("activation_checkpointing", ["none", "full"])
def test_compiled_blocks_train_to_the_same_losses_and_state_dict_names(
    world_of_one, monkeypatch, activation_checkpointing
):
    monkeypatch.setenv("TRAINER_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    options = {"activation_checkpointing": activation_checkpointing}
    eager, eager_names = train_losses(world_of_one, **options)
    compiled, compiled_names = train_losses(world_of_one, compile=True, **options)
    assert eager[-1] < eager[0]  # it learns, so the steps after the first are compared too
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert compiled_names == eager_names  # checkpoints and exports do not see the compile wrapper
