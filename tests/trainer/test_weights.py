"""Meta-device build, then each rank fills its own shards: seeded random or pretrained weights."""

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.support.training import torchrun
from tests.trainer.weights_worker import SETUPS
from trainer.model import build_model, builtin_config, init_random_weights, materialize_weights


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny untied Llama saved by save_pretrained in shards of a few tensors each."""
    config = builtin_config("tiny-llama")
    config.tie_word_embeddings = False
    torch.manual_seed(3)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()  # every weight differs from any init, norms too
    path = tmp_path_factory.mktemp("pretrained")
    model.save_pretrained(path, max_shard_size="200KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path, model.state_dict()


@pytest.fixture(scope="module")
def two_ranks(pretrained, tmp_path_factory):
    """Every setup of weights_worker.py on two gloo ranks: {name: [rank 0 result, rank 1]}."""
    out = tmp_path_factory.mktemp("weights")
    torchrun(["tests/trainer/weights_worker.py", str(out), str(pretrained[0])])
    return {
        name: [torch.load(out / f"{name}_rank{rank}.pt") for rank in range(2)] for name in SETUPS
    }


def unsharded_init(seed: int) -> dict[str, torch.Tensor]:
    model = build_model("tiny-llama")
    materialize_weights(model, "tiny-llama", seed, torch.device("cpu"))
    return model.state_dict()


def test_the_model_is_built_without_storage():
    model = build_model("llama-8b")
    assert all(p.is_meta for p in model.parameters())


def test_random_init_follows_hugging_face_llama_init():
    model = build_model("tiny-llama")
    model.to_empty(device="cpu")
    init_random_weights(model, seed=1)
    std = model.config.initializer_range
    for name, param in model.named_parameters():
        if "norm" in name:
            assert torch.equal(param, torch.ones_like(param)), name
        else:
            assert param.std().item() == pytest.approx(std, rel=0.1), name
    padding = model.model.embed_tokens.padding_idx
    if padding is not None:
        assert not model.model.embed_tokens.weight[padding].any()


def test_the_same_seed_gives_the_same_model_and_another_seed_another():
    first, again, other = unsharded_init(5), unsharded_init(5), unsharded_init(6)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"],
                           other["model.layers.0.mlp.up_proj.weight"])  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in SETUPS if n.startswith("random")])
def test_sharded_random_init_is_the_same_on_every_rank_and_for_one_process(two_ranks, name):
    reference = unsharded_init(7)
    for result in two_ranks[name]:
        assert result["tied"]
        assert set(result["state"]) == set(reference)
        for key, tensor in reference.items():
            assert torch.equal(result["state"][key], tensor), key


@pytest.mark.slow
def test_pretrained_weights_load_into_shards_equal_to_the_checkpoint(pretrained, two_ranks):
    _, expected = pretrained
    rotary = LlamaForCausalLM(builtin_config("tiny-llama")).model.rotary_emb.inv_freq
    for result in two_ranks["pretrained_full_shard"]:
        assert not result["tied"]
        assert set(result["state"]) == set(expected)
        for key, tensor in expected.items():
            assert torch.equal(result["state"][key], tensor), key
        assert torch.equal(result["rotary"], rotary)


def test_an_unknown_model_is_rejected_naming_the_choices():
    with pytest.raises(ValueError, match="tiny-llama.*a local Hugging Face model dir or a hub id"):
        build_model("no-such-org/no-such-model")  # the tests run with HF_HUB_OFFLINE=1


def test_a_model_dir_without_safetensors_weights_is_rejected(tmp_path):
    builtin_config("tiny-llama").save_pretrained(tmp_path)
    model = build_model(str(tmp_path))
    with pytest.raises(ValueError, match="has no safetensors weights"):
        materialize_weights(model, str(tmp_path), seed=0, device=torch.device("cpu"))
