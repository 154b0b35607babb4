"""The run contract's rules (plugins/finetune_contract): each problem named by its field, every
problem at once, the same words on both sides; the package imports nothing but the standard
library, so the Airflow side and the trainer image can both ship it."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from finetune_contract.data import (
    data_files,
    encode_row,
    min_packed_rows,
    read_rows,
    split_sizes,
    tokenizer_problems,
)
from finetune_contract.fields import ContractError, quoted
from finetune_contract.models import BUILTIN_MODELS, ModelShape, model_shape
from finetune_contract.parameters import PARAMETERS
from finetune_contract.rules import config_problems, path_problem, split_s3
from finetune_contract.train_config import TrainConfig
from tests.support.chat_tokenizers import without_chat_template

REPO_ROOT = Path(__file__).resolve().parents[2]
CONTRACT = REPO_ROOT / "plugins" / "finetune_contract"
TINY = model_shape("tiny-llama")


def test_the_package_opening_lists_each_of_its_modules():
    """A newcomer reads the package's docstring first: every module is on its list."""
    import finetune_contract

    listed = set(re.findall(r"^- `(\w+)`:", finetune_contract.__doc__, re.M))
    modules = {p.stem for p in CONTRACT.glob("*.py") if p.stem != "__init__"}
    assert listed == modules


def problems(world: int = 2, local: int | None = None, shape: ModelShape | None = TINY,
             **fields) -> list[tuple[str, str]]:
    return config_problems(TrainConfig(**fields), world_size=world,
                           local_world_size=world if local is None else local, shape=shape)


def test_the_contract_imports_only_the_standard_library_and_itself():
    allowed = set(sys.stdlib_module_names) | {"finetune_contract"}
    for path in CONTRACT.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            # pyarrow is optional (parquet), imported inside a function that falls back;
            # transformers_import imports transformers in its functions (the classes both sides
            # take from it), never at import
            extra = {"pyarrow"} | ({"transformers"} if path.name == "transformers_import.py"
                                   else set())
            assert all(n.split(".")[0] in allowed | extra for n in names), (path, names)
    # and it imports with no torch, transformers or airflow present
    code = ("import sys; [sys.modules.__setitem__(m, None) for m in "
            "('torch', 'transformers', 'airflow', 'datasets')]; "
            "import finetune_contract.rules, finetune_contract.data, finetune_contract.models, "
            "finetune_contract.transformers_import")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=CONTRACT.parent)


CASES = [
    # (fields, world, local, field named, words in its message)
    ({"activation_checkpointing": "selective", "selective_ac": "two"}, 2, 2, "selective_ac",
     "positive integer"),
    ({"selective_ac": "2"}, 2, 2, "selective_ac", "applies only to activation_checkpointing"),
    ({"float8": True}, 2, 2, "float8", "needs mixed_precision bf16"),
    ({"float8_recipe": "rowwise"}, 2, 2, "float8_recipe", "float8 is false: set float8 to true"),
    ({"float8": True, "mixed_precision": "bf16", "seq_len": 100}, 2, 2, "float8",
     "divisible by 16"),
    ({"float8": True, "mixed_precision": "bf16", "cpu_offload": True}, 2, 2, "float8",
     "cannot be combined with cpu_offload"),
    ({"float8": True, "mixed_precision": "bf16", "lora_rank": 8}, 2, 2, "float8",
     "cannot be combined with lora_rank"),
    ({"lora_rank": 8, "tp_degree": 2}, 2, 2, "lora_rank", "tp_degree"),
    ({"lora_rank": 8, "lora_target_modules": " , "}, 2, 2, "lora_target_modules",
     "comma-separated"),
    ({"lora_rank": 8, "lora_target_modules": "q_proj;v_proj"}, 2, 2, "lora_target_modules",
     "comma-separated"),
    ({"tp_degree": 4}, 6, 6, "tp_degree", "does not divide the processes per node (6)"),
    ({"tp_degree": 2}, 3, 2, "tp_degree", "does not divide the world size (3)"),
    ({"tp_degree": 2, "seq_len": 127}, 2, 2, "tp_degree", "does not divide seq_len"),
    ({"tp_degree": 2, "cpu_offload": True}, 2, 2, "cpu_offload", "tp_degree"),
    ({"tp_degree": 4}, 4, 4, "tp_degree", "tiny-llama's num_key_value_heads (2)"),
    ({"strategy": "HYBRID_SHARD", "shard_group_size": 4, "tp_degree": 2}, 12, 12,
     "shard_group_size", "data-parallel size (6 = world size 12 / tp_degree 2)"),
    ({"strategy": "HYBRID_SHARD", "tp_degree": 2}, 6, 4, "shard_group_size",
     "(2, processes per node / tp_degree (shard_group_size 0)) does not divide"),
    ({"strategy": "HYBRID_SHARD", "shard_group_size": 3}, 4, 4, "shard_group_size",
     "does not divide"),
    ({"shard_group_size": 2}, 2, 2, "shard_group_size", "HYBRID_SHARD only"),
    ({"prompt_template": "chat", "text_field": "text"}, 2, 2, "prompt_template", "text_field"),
    ({"output_dir": "s3://"}, 2, 2, "output_dir", "needs a bucket"),
    ({"output_dir": "s3://Bad_Bucket/runs"}, 2, 2, "output_dir", "not a valid S3 bucket"),
    ({"output_dir": "s3://bucket/"}, 2, 2, "output_dir", "give a key"),
    ({"output_dir": "s3://192.168.1.1/runs"}, 2, 2, "output_dir", "IP address"),
    ({"dataset": "s3://ab/x"}, 2, 2, "dataset", "not a valid S3 bucket"),
    ({"dataset": "s3://bucket/a//b"}, 2, 2, "dataset", "empty part"),
    ({"output_dir": "/tmp/" + "x" * 300}, 2, 2, "output_dir", "300 bytes"),
]


@pytest.mark.parametrize(("fields", "world", "local", "field", "words"), CASES,
                         ids=[f"{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_each_rule_names_its_field_and_says_why(fields, world, local, field, words):
    found = problems(world, local, **fields)
    assert any(f == field and words in m for f, m in found), found


def test_working_combinations_have_no_problems():
    for fields, world in [
        ({"activation_checkpointing": "selective", "selective_ac": "3"}, 8),
        ({"mixed_precision": "fp16", "cpu_offload": True, "activation_offload": True}, 8),
        ({"float8": True, "mixed_precision": "bf16", "strategy": "HYBRID_SHARD"}, 8),
        ({"tp_degree": 2, "strategy": "HYBRID_SHARD", "shard_group_size": 2}, 8),
        ({"output_dir": "s3://my-bucket/runs/a", "dataset": "s3://data.example/set/"}, 2),
    ]:
        assert problems(world, **fields) == [], fields
    llama8b = model_shape("llama-8b")
    assert problems(8, shape=llama8b, tp_degree=8, seq_len=32768) == []


def test_every_problem_is_reported_at_once():
    found = problems(4, float8=True, seq_len=100, selective_ac="2", shard_group_size=2,
                     output_dir="s3://")
    assert {f for f, _ in found} >= {"float8", "selective_ac", "shard_group_size", "output_dir"}


def test_a_train_config_refuses_every_bad_field_at_once_naming_each():
    with pytest.raises(ContractError) as err:
        TrainConfig(lr=-1, strategy="ZERO3", micro_batch=2.5, bad_rows="drop", model="")
    assert {f for f, _ in err.value.errors} == {"lr", "strategy", "micro_batch", "bad_rows",
                                                 "model"}


def test_long_values_are_cut_in_messages():
    with pytest.raises(ContractError) as err:
        TrainConfig(strategy="X" * 10_000)
    assert len(str(err.value)) < 400 and "10002 characters" in str(err.value)
    assert len(quoted("y" * 500)) < 120


def test_every_number_parameter_has_bounds_and_every_default_is_allowed():
    for parameter in PARAMETERS:
        if parameter.type in (int, float):
            assert parameter.bounds is not None, parameter.name
        assert parameter.problem(parameter.default) is None, parameter.name
        if parameter.choices is not None:
            assert parameter.default in parameter.choices, parameter.name


def test_builtin_shapes_give_heads_mlp_and_positions():
    assert TINY == ModelShape("tiny-llama", 4, 2, 352, 1024, head_dim=32)  # hidden 128 / 4 heads
    assert set(BUILTIN_MODELS) == {"tiny-llama", "llama-1b", "llama-3b", "llama-8b", "llama-70b"}


def test_a_model_directorys_shape_comes_from_its_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 6, "intermediate_size": 100, "max_position_embeddings": 64}))
    shape = model_shape(str(tmp_path), tmp_path)
    assert (shape.num_attention_heads, shape.num_key_value_heads) == (6, 6)
    assert problems(4, shape=shape, tp_degree=4)[0][0] == "tp_degree"
    assert model_shape("org/name", None) is None


def test_s3_uris_split_into_bucket_and_key():
    assert split_s3("s3://my-bucket/runs/a/") == ("my-bucket", "runs/a")
    for bad in ("s3://", "s3:///key", "s3://bucket", "s3://xn--bucket/k", "s3://a..b/k"):
        with pytest.raises(ValueError):
            split_s3(bad)


def test_a_name_over_255_bytes_is_a_path_problem_not_an_oserror():
    assert path_problem("/ok/" + "é" * 128) is not None  # 256 bytes in UTF-8
    assert path_problem("/ok/" + "e" * 255) is None


def test_data_files_and_rows_are_read_as_the_trainer_reads_them(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"prompt": "p", "response": "r"}\nnot json\n\n[1]\n')
    (tmp_path / "_SUCCESS").write_text("")
    files = data_files(tmp_path, "auto")
    rows = read_rows(files, "auto", limit=100)
    assert files == [str(tmp_path / "a.jsonl")] and len(rows.rows) == 1
    assert [what.split(" (")[0] for _, what in rows.malformed] == ["not JSON",
                                                                     "a JSON list, not an object"]
    assert rows.columns == ["prompt", "response"]
    one_object = tmp_path / "one.json"
    one_object.write_text('{"prompt": "p", "response": "r"}')
    with pytest.raises(ValueError, match="holds a JSON dict; a .json data file holds a list"):
        read_rows([str(one_object)], "auto", limit=100)
    with pytest.raises(ValueError, match="holds no data files"):
        data_files(tmp_path / "empty", "auto") if (tmp_path / "empty").mkdir() is None else None


def test_a_tokenizer_directory_needs_tokenizer_files_and_chat_needs_a_template(tmp_path):
    demo = REPO_ROOT / "trainer" / "demo" / "tokenizer"
    assert tokenizer_problems(demo, "tokenizer", TrainConfig()) == []
    assert tokenizer_problems(tmp_path, "tokenizer", TrainConfig())[0][1].endswith(
        "has no tokenizer files (one of tokenizer.json, tokenizer.model, vocab.json, "
        "vocab.txt, spiece.model)")
    chat = TrainConfig(prompt_template="chat")
    # The demo tokenizer has a chat template (conversations render with it); a copy without.
    assert tokenizer_problems(demo, "tokenizer", chat) == []
    plain = without_chat_template(tmp_path / "plain")
    assert tokenizer_problems(plain, "tokenizer", chat)[0][0] == "prompt_template"
    assert tokenizer_problems(plain, "tokenizer", TrainConfig(messages_field="messages"))[0][0] \
        == "messages_field"


def test_the_eval_split_and_packing_bounds_are_the_trainers():
    assert split_sizes(40, TrainConfig(micro_batch=20)) == (20, 20)
    assert split_sizes(40, TrainConfig(micro_batch=21)) == (19, 21)
    with pytest.raises(ValueError, match="too few for an eval split"):
        split_sizes(40, TrainConfig(micro_batch=40))
    assert min_packed_rows([10, 20, 30, 40], seq_len=64, train_rows=3) == 1


def test_a_row_too_long_for_seq_len_is_a_problem_not_truncated():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO_ROOT / "trainer" / "demo" / "tokenizer")
    row = {"prompt": "Repeat cat 4 times.", "response": "cat cat cat cat"}
    problem, ids, _ = encode_row(tokenizer, TrainConfig(seq_len=128), row)
    assert problem is None and ids
    problem, ids, _ = encode_row(tokenizer, TrainConfig(seq_len=8), row)
    assert problem[0] == "too_long" and ids == []
    assert encode_row(tokenizer, TrainConfig(), {"prompt": "p"})[0][0] == "missing_field"
