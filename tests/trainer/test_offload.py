"""Offloaded blocks and tiled MLPs (trainer/offload.py) give the gradients of the plain model."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from finetune_contract.families import FAMILIES, family_of
from finetune_contract.rules import (
    MLP_TILE_TOKENS,
    QUANTIZED_MLP_MIN_TILE_TOKENS,
    min_mlp_tile_tokens,
    mlp_tile_fraction,
    mlp_tiles,
)
from tests.support.families import family_config
from trainer.blocks import decoder_blocks
from trainer.config import load_config
from trainer.offload import HostBuffers, HostOffloader, _Tiles, offload_blocks


def _grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def _offloaded(model: torch.nn.Module, tile_tokens: int, output_unread: bool = True
               ) -> HostOffloader:
    return offload_blocks(decoder_blocks(model), torch.device("cpu"), tile_tokens=tile_tokens,
                          output_unread=output_unread)


def _twins(model_type: str) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    """(plain, a second model with the same weights, config) of a family, fp32, seeded."""
    torch.manual_seed(0)
    config = family_config(model_type)
    plain = AutoModelForCausalLM.from_config(config).float()
    other = AutoModelForCausalLM.from_config(config).float()
    other.load_state_dict(plain.state_dict())
    return plain, other, config


def _llama_offloaded(tile_tokens: int = 4) -> tuple[torch.nn.Module, HostOffloader, object]:
    config = family_config("llama")
    model = AutoModelForCausalLM.from_config(config)
    return model, _offloaded(model, tile_tokens), config


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
@pytest.mark.parametrize("tile_tokens", [5, 4096])
def test_offloaded_tiled_blocks_give_the_plain_models_loss_and_gradients(model_type, tile_tokens):
    """Every family: the same loss and every parameter's gradient, with the MLP in several
    slices (5 tokens: 24 rows in 5) and in one; for families whose MLP output feeds a norm
    (Gemma, OLMo 2) the recompute must compute it, for the others it may skip it."""
    plain, offloaded, config = _twins(model_type)
    names = [n for n, _ in offloaded.named_parameters()]
    _offloaded(offloaded, tile_tokens, family_of(config).mlp_output_unread)
    assert [n for n, _ in offloaded.named_parameters()] == names  # checkpoints see the same
    ids = torch.randint(0, config.vocab_size, (2, 12))
    loss, grads = _grads(plain, ids)
    offloaded_loss, offloaded_grads = _grads(offloaded, ids)
    torch.testing.assert_close(offloaded_loss, loss)
    assert offloaded_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(offloaded_grads[name], grad, rtol=1e-4, atol=1e-6,
                                   msg=name)


def test_a_family_whose_mlp_output_feeds_a_norm_may_not_skip_it():
    assert not FAMILIES["gemma2"].mlp_output_unread
    assert not FAMILIES["olmo2"].mlp_output_unread
    assert FAMILIES["llama"].mlp_output_unread


def test_skipping_the_mlp_where_a_norm_reads_it_would_change_the_gradients():
    """The test above can fail: Gemma 2 told its MLP output is unread gets other gradients."""
    plain, wrong, config = _twins("gemma2")
    _offloaded(wrong, tile_tokens=5, output_unread=True)
    ids = torch.randint(0, config.vocab_size, (2, 12))
    _, grads = _grads(plain, ids)
    _, wrong_grads = _grads(wrong, ids)
    assert any(not torch.allclose(wrong_grads[n], g, rtol=1e-3, atol=1e-5)
               for n, g in grads.items())


def test_evaluation_without_gradients_stores_nothing():
    model, offloader, config = _llama_offloaded(4)
    with torch.no_grad():
        model(input_ids=torch.randint(0, config.vocab_size, (1, 8)))
    assert offloader.live == [] and offloader.buffers.free == []


def test_each_step_reuses_the_host_buffers_of_the_last():
    model, offloader, config = _llama_offloaded(4)
    ids = torch.randint(0, config.vocab_size, (1, 8))
    for _ in range(3):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        assert offloader.live == []
        # one buffer per block, each block input's size (8 tokens x 32 x fp32)
        assert sorted(b.numel() for b in offloader.buffers.free) == [8 * 32 * 4] * 2


def test_two_forwards_before_one_backward_keep_their_inputs_apart():
    """DPO's chosen and rejected halves, or any two forwards: each block input has a buffer."""
    plain, offloaded, config = _twins("llama")
    _offloaded(offloaded, tile_tokens=3)
    a, b = (torch.randint(0, config.vocab_size, (1, 10)) for _ in range(2))
    grads = []
    for model in (plain, offloaded):
        model.zero_grad(set_to_none=True)
        (model(input_ids=a, labels=a, use_cache=False).loss
         + 2 * model(input_ids=b, labels=b, use_cache=False).loss).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_host_buffers_are_taken_at_their_size_and_given_back():
    buffers = HostBuffers(pin=False)
    big, small = buffers.take(1000), buffers.take(800)
    assert (big.numel(), small.numel()) == (1000, 800)  # not rounded up to a power of two
    buffers.give_back(big)
    buffers.give_back(small)
    assert buffers.take(600) is small  # the smallest free one that holds it
    assert buffers.take(900) is big
    assert buffers.take(600).numel() == 600  # none free: a new one


def test_an_offloader_copies_out_and_back_on_a_cpu_device():
    offloader = HostOffloader(torch.device("cpu"))
    x = torch.randn(3, 4)
    stored = offloader.store(x)
    x.add_(1)  # the stored copy is the value at store time
    back = offloader.fetch(stored)
    torch.testing.assert_close(back, x - 1)
    assert offloader.live == []


@pytest.mark.parametrize("tokens,tiles,nf4_tiles", [
    (1, 1, 1), (3, 3, 1), (8192, 4, 1), (16384, 4, 2), (32768, 4, 4), (131_072, 4, 4),
    (131_073, 5, 5), (409_600, 13, 13)])
def test_mlp_tiles_is_the_ceiling_of_tokens_over_the_tile_at_least_four_of_8k_for_nf4(
    tokens, tiles, nf4_tiles
):
    assert mlp_tiles(tokens) == tiles
    assert mlp_tiles(tokens, min_tile_tokens=QUANTIZED_MLP_MIN_TILE_TOKENS) == nf4_tiles


@pytest.mark.parametrize("quantize_base", ["none", "nf4"])
@pytest.mark.parametrize("tokens", [8, 8192, 12_288, 16_383, 20_000, 32768, 50_000, 409_600])
def test_the_planners_mlp_slice_is_the_trainers(quantize_base, tokens):
    """The planner's share of the tokens one MLP slice holds is what the trainer's slices hold
    (within the rounding of a ceiling), for LoRA and 4-bit bases, short and long."""
    cfg = load_config(None, {"activation_checkpointing": "full", "activation_offload": True,
                             "lora_rank": 4, "quantize_base": quantize_base})
    tiles = mlp_tiles(tokens, min_tile_tokens=min_mlp_tile_tokens(cfg))
    largest = max(s.stop - s.start for s in _Tiles(torch.nn.Linear(1, 1), None, MLP_TILE_TOKENS,
                                                  True, min_mlp_tile_tokens(cfg)).slices(tokens))
    assert largest == -(-tokens // tiles)
    assert mlp_tile_fraction(cfg, tokens) == largest / tokens


def test_an_offloaded_block_refuses_a_kv_cache():
    model, _, config = _llama_offloaded(4)
    ids = torch.randint(0, config.vocab_size, (1, 8))
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=ids, labels=ids, use_cache=True)


def test_a_seq_len_beyond_the_models_positions_stretches_its_rope_linearly():
    """tiny-llama has 1,024 positions: at 2,048 its RoPE interpolates positions by 2 (what
    the export's config.json then holds); within them nothing changes."""
    from finetune_contract.models import extended_rope
    from trainer.model import build_model

    assert build_model("tiny-llama", seq_len=1024).config.rope_parameters["rope_type"] == "default"
    config = build_model("tiny-llama", seq_len=2048).config
    assert config.rope_parameters["rope_type"] == "linear"
    assert config.rope_parameters["factor"] == 2.0 and config.max_position_embeddings == 2048
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert extended_rope(llama3, 131072, 393216) == {**llama3, "factor": 24.0}
    with pytest.raises(ValueError, match="'yarn' is not one the trainer stretches"):
        extended_rope({"rope_type": "yarn", "factor": 4.0}, 1024, 2048)


def test_the_mlp_runs_in_slices_in_every_pass_never_whole():
    """The checkpoint's forward runs without gradients: its MLP must be sliced too (at 400k
    tokens a whole 8B MLP tensor is 10.7 GiB; an H100 ran out of memory on it)."""
    model, _, config = _llama_offloaded(5)
    widest = []
    for block in decoder_blocks(model):
        tiles = block.mlp.forward
        inner = tiles.compute
        tiles.compute = lambda x, inner=inner: widest.append(x.shape[0]) or inner(x)
    ids = torch.randint(0, config.vocab_size, (2, 12))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert widest and max(widest) <= 5


def test_a_forward_whose_backward_never_comes_gives_its_buffers_back():
    model, offloader, config = _llama_offloaded(4)
    ids = torch.randint(0, config.vocab_size, (1, 8))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert len(offloader.live) == 2 and offloader.buffers.free == []
    del loss  # the graph goes, its backward never ran
    assert offloader.live == [] and len(offloader.buffers.free) == 2


def test_the_trainer_refuses_offloaded_inputs_beyond_the_machines_free_memory(monkeypatch):
    """The local target's check at start: 2 processes of 8B at 1M tokens would page-lock
    2 x 256 GiB; refused naming the figures, before any weight is made."""
    from types import SimpleNamespace

    from finetune_contract.fields import ContractError
    from trainer.config import TrainConfig
    from trainer.model import builtin_config
    from trainer.parallel import DistEnv, check_start

    monkeypatch.setattr("psutil.virtual_memory", lambda: SimpleNamespace(available=64 << 30))
    env = DistEnv(0, 2, 0, 2, torch.device("cpu"))
    config = TrainConfig(model="llama-8b", seq_len=1_048_576, micro_batch=1, mixed_precision="bf16",
                         activation_checkpointing="full", activation_offload=True)
    with pytest.raises(ContractError, match=r"512\.0 GiB of CPU memory on this machine "
                                            r"\(2 x 256\.0\), more than the 64\.0 GiB"):
        check_start(config, env, builtin_config("llama-8b"))
    check_start(TrainConfig(model="llama-8b", seq_len=65_536, micro_batch=1, mixed_precision="bf16",
                            activation_checkpointing="full", activation_offload=True),
                env, builtin_config("llama-8b"))  # 2 x 16 GiB: fits
