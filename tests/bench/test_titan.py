"""The torchtitan peer's pure parts (bench/titan.py), without torchtitan installed."""

import math

import pytest
import torch

from bench.titan import IGNORE_INDEX, TITAN_SHAPES, titan_labels, titan_problem
from bench.train import PEERS, bench_config, parse_args, peer_child_argv
from finetune_contract.models import BUILTIN_MODELS


@pytest.mark.parametrize("name", sorted(TITAN_SHAPES))
def test_titans_shape_is_the_benchs_model_of_that_name(name):
    """The same layers, heads, widths and tying; the FFN width by torchtitan's FeedForward rule
    (the runner also checks the parameter counts equal, on the GPU)."""
    assert name in BUILTIN_MODELS
    shape, tied = TITAN_SHAPES[name]
    config = bench_config(name)
    hidden = int(shape["ffn_dim_multiplier"] * int(2 * 4 * shape["dim"] / 3))
    hidden = shape["multiple_of"] * math.ceil(hidden / shape["multiple_of"])
    assert (shape["dim"], shape["n_layers"], shape["n_heads"], shape["n_kv_heads"], hidden,
            shape["rope_theta"], tied) == (
        config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
        config.num_key_value_heads, config.intermediate_size, config.rope_parameters["rope_theta"],
        config.tie_word_embeddings)


@pytest.mark.parametrize("flag", [["--lora-rank", "16"], ["--lora-rank", "16", "--quantize-base",
                                  "nf4"], ["--float8"], ["--tp-degree", "2"]])
def test_titan_refuses_what_it_would_not_run_the_same_way_naming_the_flag(flag):
    args = parse_args(["--models", "8b", "--peers", "titan", *flag])
    assert flag[0] in titan_problem("llama-8b", args)


def test_titan_refuses_a_shape_it_has_not_naming_the_ones_it_has():
    args = parse_args(["--models", "mistral-7b", "--peers", "titan"])
    problem = titan_problem("mistral-7b", args)
    assert "mistral-7b" in problem and "llama-3b" in problem
    assert titan_problem("llama-3b", parse_args(["--models", "3b"])) is None


def test_titan_labels_are_the_next_tokens_with_the_last_ignored():
    ids = torch.randint(0, 100, (2, 7))
    labels = titan_labels(ids)
    assert torch.equal(labels[:, :-1], ids[:, 1:])
    assert (labels[:, -1] == IGNORE_INDEX).all()
    # seq_len - 1 labelled tokens a row: what the bench's other runs count as tokens
    assert int((labels != IGNORE_INDEX).sum()) == 2 * 6


def test_the_peer_child_runs_one_model_and_one_peer_without_the_kernel_check():
    argv = ["--models", "1b,3b", "--attention-check", "--peers", "hf,titan", "--compile"]
    child = peer_child_argv(argv, "llama-3b", "titan")
    args = parse_args(child)
    assert args.models == ["llama-3b"] and args.peer_worker == "titan"
    assert not args.attention_check and args.compile
    assert PEERS["titan"] == "titan"


def test_an_unknown_peer_is_refused_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--peers", "megatron"])
    assert "titan" in capsys.readouterr().err


def test_no_hf_leaves_out_hugging_face_trainer_not_the_other_peers():
    assert parse_args(["--no-hf"]).peers == []
    assert parse_args(["--peers", "titan", "--no-hf"]).peers == ["titan"]
    assert parse_args(["--peers", "hf,titan", "--no-hf"]).peers == ["titan"]
