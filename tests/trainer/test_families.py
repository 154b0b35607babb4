"""The architecture table's families through every path: small random models of each family
(transformers config classes, saved by the test; the demo tokenizer; no hub) on 2 CPU ranks."""

import inspect
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from finetune_contract.families import FAMILIES, attention_windows, parameter_count
from finetune_contract.fields import DEMO_PREFERENCES
from tests.support import REPO_ROOT
from tests.support.families import MATRIX, SHAPE, TOKENIZER, family_config
from tests.support.training import demo_rows, read_metrics, torchrun, write_jsonl
from tests.trainer.families_worker import CHECKPOINT_AT, STEPS, setups_of
from trainer.config import load_config
from trainer.evaluate import eval_rows, loss_on
from trainer.model import build_model, init_buffers, materialize_weights
from trainer.parallel import QUANTIZE_ON_CPU_ENV


def test_every_family_of_the_architecture_table_is_in_the_matrix():
    assert sorted(MATRIX) == sorted(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_tables_parameter_count_is_the_built_models(model_type):
    config = family_config(model_type)
    for tied in (False, True):
        config.tie_word_embeddings = tied
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert sum(parameter_count(config).values()) == sum(p.numel() for p in model.parameters())
        assert sum(parameter_count(config.to_dict()).values()) == sum(parameter_count(
            config).values())


# Window settings a config.json may hold (transformers' defaults fill the rest).
WINDOW_VARIANTS = ({}, {"sliding_window": 16}, {"sliding_window": None},
                   {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 2},
                   {"sliding_window": 16, "sliding_window_pattern": 3})


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_tables_sliding_windows_are_the_ones_each_layer_applies(model_type):
    """The FLOPs (attention_windows) count per layer the window the family's transformers
    model applies: read off the built layers, for config.json as transformers writes it
    (layer_types included) and as an older one without layer_types holds it."""
    for variant in WINDOW_VARIANTS:
        raw = {**SHAPE, "num_hidden_layers": 6, "pad_token_id": 0, **variant}
        config = AutoConfig.for_model(model_type, **raw)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        attention = type(model.model.layers[0].self_attn)
        # a layer's own window; else the config's, where the attention passes it (Mistral's)
        passed = config.sliding_window if "sliding_window" in inspect.getsource(
            attention.forward) else None
        applied = [getattr(layer.self_attn, "sliding_window", passed)
                   for layer in model.model.layers]
        assert attention_windows(config.to_dict()) == applied, (variant, applied)
        assert attention_windows({"model_type": model_type, **raw}) == applied, (variant, applied)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_pretrained_family_model_loads_on_the_meta_build_with_its_buffers(model_type,
                                                                            tmp_path):
    """The meta-device build, filled from the saved weights, computes the saved model's logits
    (Gemma's embedding scale is a buffer in no checkpoint)."""
    torch.manual_seed(0)
    saved = AutoModelForCausalLM.from_config(family_config(model_type)).eval()
    saved.save_pretrained(tmp_path)
    model = build_model(str(tmp_path))
    materialize_weights(model, str(tmp_path), seed=0, device=torch.device("cpu"))
    init_buffers(model)
    input_ids = torch.tensor([[1, 5, 9, 200, 3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=input_ids).logits,
                                   saved(input_ids=input_ids).logits)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Every family's set-ups (families_worker.SETUPS) in one torchrun; its seconds."""
    models = tmp_path_factory.mktemp("families")
    tokenizer = AutoTokenizer.from_pretrained(REPO_ROOT / TOKENIZER)
    for model_type in MATRIX:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(family_config(model_type)).save_pretrained(
            models / model_type)
        tokenizer.save_pretrained(models / model_type)
    # 80 rows: 4 held out, more than the steps take.
    dataset = write_jsonl(tmp_path_factory.mktemp("data") / "rows.jsonl", demo_rows(80))
    out = tmp_path_factory.mktemp("matrix")
    started = time.time()
    torchrun(["tests/trainer/families_worker.py", str(models), str(dataset),
              str(REPO_ROOT / DEMO_PREFERENCES), str(out), *MATRIX], timeout=900)
    seconds = time.time() - started
    print(f"\nfamily matrix: {len(MATRIX)} families, {seconds:.0f} s")
    return out


def train_records(output_dir) -> dict[int, dict[str, float]]:
    return {r["step"]: r for r in read_metrics(output_dir) if r["type"] == "train"}


def train_losses(output_dir) -> dict[int, float]:
    return {step: r["loss"] for step, r in train_records(output_dir).items()}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(MATRIX))
def test_every_family_trains_resumes_and_exports_on_every_path(matrix, model_type):
    """full, resumed from its checkpoint, LoRA with packing, DPO with LoRA and TP 2 (where the
    table has a plan; the same losses and gradient norms as full without TP): each exports a
    model that loads as the family's class and whose teacher-forced eval loss is the run's
    reported final eval loss."""
    runs = matrix / model_type
    full, resumed = train_losses(runs / "full"), train_losses(runs / "resumed")
    assert sorted(full) == list(range(1, STEPS + 1))
    assert sorted(resumed) == [STEPS]  # it started after step CHECKPOINT_AT = STEPS - 1
    assert resumed[STEPS] == pytest.approx(full[STEPS], rel=1e-5)
    assert all(math.isfinite(loss) for loss in full.values())
    if "tp2" in setups_of(model_type):
        tp, without = train_records(runs / "tp2"), train_records(runs / "full")
        assert sorted(tp) == sorted(without)
        for step, record in tp.items():
            assert record["loss"] == pytest.approx(without[step]["loss"], rel=1e-5), step
            assert record["grad_norm"] == pytest.approx(without[step]["grad_norm"], rel=1e-4)
    for setup in setups_of(model_type):
        summary = json.loads((runs / setup / "summary.json").read_text())
        exported = AutoModelForCausalLM.from_pretrained(runs / setup / "model")
        assert type(exported).__name__ == FAMILIES[model_type].causal_lm
        if summary["config"]["method"] == "dpo":
            continue  # its eval measures preference, not the loss of the rows
        config = load_config(None, summary["config"])
        tokenizer = AutoTokenizer.from_pretrained(runs / setup / "model")
        loss = loss_on(exported, eval_rows(config), 4, tokenizer.pad_token_id,
                       torch.device("cpu"))
        assert loss == pytest.approx(summary["final_eval_loss"], rel=1e-5), setup
    assert (runs / "full" / "checkpoints" / f"step_{CHECKPOINT_AT:08d}").is_dir()


@pytest.mark.slow
def test_qlora_trains_every_family_through_the_benchmark(tmp_path):
    """QLoRA (NF4 base, LoRA rank 8 on the family's default targets) on each family's tiny
    config, through bench.train's config-directory rows: on a GPU for real (bf16, torchao's
    NF4 kernels), elsewhere with NF4 emulated on the CPU. Every family runs, with its blocks'
    Linears stored in NF4 and finite losses."""
    dirs = []
    for model_type in sorted(MATRIX):
        family_config(model_type).save_pretrained(tmp_path / model_type)
        dirs.append(str(tmp_path / model_type))
    env = {**os.environ, "OMP_NUM_THREADS": "1",  # the caller's path too: its packages
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                        os.environ.get("PYTHONPATH")]))}
    if not torch.cuda.is_available():
        env[QUANTIZE_ON_CPU_ENV] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "bench.train", "--models", ",".join(dirs), "--no-hf",
         "--lora-rank", "8", "--quantize-base", "nf4", "--seq-len", "64", "--micro-batch", "2",
         "--steps", "2", "--warmup", "1"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {Path(r["model"]).name: r for r in map(json.loads, done.stdout.splitlines())}
    print("\n" + "\n".join(f"{name}: {row.get('error') or 'ran'} ({row.get('device')})"
                           for name, row in rows.items()))
    failed = {name: row["error"] for name, row in rows.items() if "error" in row}
    assert not failed
    assert sorted(rows) == sorted(MATRIX)
    for row in rows.values():
        assert row["options"]["quantize_base"] == "nf4" and row["options"]["nf4_gib"] > 0
        assert math.isfinite(row["loss_first"]) and math.isfinite(row["loss_last"])
