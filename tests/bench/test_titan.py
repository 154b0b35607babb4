"""The torchtitan peer (bench/titan.py): its pure parts without torchtitan installed; its float8
wiring and a CPU step where torchtitan 0.2.2 can be imported (skipped otherwise: it is no
requirement of the project; PYTHONPATH a --target install of it and its imports to run them)."""

import math

import pytest
import torch

from bench.titan import (
    BLOCK_LINEARS,
    IGNORE_INDEX,
    TITAN_SHAPES,
    titan_labels,
    titan_problem,
)
from bench.train import PEERS, bench_config, parse_args, peer_child_argv
from finetune_contract.models import BUILTIN_MODELS
from trainer.float8 import EMULATE_ENV

RECIPES = ["tensorwise", "rowwise"]
# A tiny llama3 for torchtitan on a CPU: its dims divisible by 16 (the head's too, so only the
# filter keeps it out of float8).
TINY_TITAN = dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim_multiplier=1.0,
                  multiple_of=256, rope_theta=500000)


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
                                  "nf4"], ["--tp-degree", "2"], ["--float8", "--tp-degree", "2"]])
def test_titan_refuses_what_it_would_not_run_the_same_way_naming_the_flag(flag):
    args = parse_args(["--models", "8b", "--peers", "titan", *flag])
    assert flag[-2] in titan_problem("llama-8b", args)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", sorted(TITAN_SHAPES))
def test_titan_runs_float8_beside_ours_in_either_recipe(name, recipe):
    args = parse_args(["--models", name, "--compile", "--float8", "--float8-recipe", recipe,
                       "--peers", "titan", "--no-hf"])
    assert titan_problem(name, args) is None
    assert args.peers == ["titan"]  # --no-hf leaves out Hugging Face Trainer, not the others


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


@pytest.fixture
def titan_cpu(monkeypatch):
    """torchtitan importable (else skipped), torchao's float8 emulated as in ours' tests (no
    float8 tensor cores here), and inductor's config restored after (its rowwise converter sets
    emulate_precision_casts for good)."""
    pytest.importorskip("torchtitan", reason="torchtitan 0.2.2 is not installed here")
    import torch._inductor.config as inductor_config

    monkeypatch.setenv(EMULATE_ENV, "1")
    saved = inductor_config.save_config()
    yield
    inductor_config.load_config(saved)


def tiny_titan():
    """torchtitan's meta llama3 at TINY_TITAN, its job config and one-rank ParallelDims."""
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    with torch.device("meta"):
        model = Transformer(TransformerModelArgs(**TINY_TITAN, vocab_size=1024, max_seq_len=64))
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    return model, JobConfig(), dims


@pytest.mark.parametrize("recipe", RECIPES)
def test_titans_float8_converts_the_block_linears_ours_converts_with_ours_config(
    recipe, titan_cpu
):
    from torchao.float8.float8_linear import Float8Linear

    from bench.titan import titan_float8
    from trainer.blocks import decoder_blocks
    from trainer.float8 import convert_to_float8
    from trainer.model import build_model

    model, job, dims = tiny_titan()
    converters, options = titan_float8(model, job, dims, recipe)
    converted = {fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {f"layers.{i}.{linear}" for i in range(TINY_TITAN["n_layers"])
                         for linear in ("attention.wq", "attention.wk", "attention.wv",
                                        "attention.wo", "feed_forward.w1", "feed_forward.w2",
                                        "feed_forward.w3")}
    assert type(model.output) is torch.nn.Linear  # the head in bf16, as ours
    assert options["float8_linears"] == BLOCK_LINEARS * TINY_TITAN["n_layers"] == len(converted)
    assert options["float8_same_linears_as_ours"] and options["float8_config_as_ours"]
    assert options["float8_recipe_name"] == (None if recipe == "tensorwise" else "rowwise")
    assert options["float8_filter_fqns"] == ["output"]
    assert not options["float8_fsdp_all_gather"]  # one GPU: no FSDP on either side
    assert len(converters.converters) == 1
    # Ours: the same seven a block, nothing else.
    with torch.device("meta"):
        ours = build_model("tiny-llama")
    blocks = decoder_blocks(ours)
    assert convert_to_float8(blocks, sharded=False, recipe=recipe) == BLOCK_LINEARS * len(blocks)


def test_titans_float8_refuses_a_model_whose_conversion_is_not_ours(titan_cpu, monkeypatch):
    """Had its filter let the head through, the run would compare other work: it stops."""
    from bench import titan

    model, job, dims = tiny_titan()
    settings = titan.titan_float8_settings
    monkeypatch.setattr(titan, "titan_float8_settings", lambda job, recipe: (
        settings(job, recipe), setattr(job.quantize.linear.float8, "filter_fqns", [])))
    with pytest.raises(ValueError, match="15 Linears \\(output outside the blocks\\)"):
        titan.titan_float8(model, job, dims, "tensorwise")


@pytest.mark.parametrize("recipe", RECIPES)
def test_titans_float8_step_runs_on_a_cpu_and_calls_its_post_optimizer_hook(
    recipe, titan_cpu, monkeypatch
):
    """titan_step_runner end to end at a tiny shape (torchao's float8 casts on a CPU): losses,
    the options of what ran, and the converters' hook after each optimizer step."""
    from torchtitan.protocols.model_converter import ModelConvertersContainer

    from bench.titan import titan_step_runner

    calls = []
    hook = ModelConvertersContainer.post_optimizer_hook
    monkeypatch.setattr(ModelConvertersContainer, "post_optimizer_hook",
                        lambda self, parts: (calls.append(len(parts)), hook(self, parts)))
    monkeypatch.setitem(TITAN_SHAPES, "tiny-titan", (TINY_TITAN, True))
    args = parse_args(["--models", "1b", "--float8", "--float8-recipe", recipe, "--seq-len",
                       "32", "--micro-batch", "2"])
    try:
        step, options = titan_step_runner("tiny-titan", args, torch.device("cpu"))
        ids = torch.randint(0, 128256, (1, 2, 32), generator=torch.Generator().manual_seed(0))
        losses = [step(ids), step(ids)]
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert all(math.isfinite(loss) for loss in losses) and losses[1] < losses[0]
    assert calls == [1, 1]  # its Trainer's hook, on the one model part, after each step
    assert options["float8"] and options["float8_recipe"] == recipe
    assert options["float8_linears"] == BLOCK_LINEARS * TINY_TITAN["n_layers"]
