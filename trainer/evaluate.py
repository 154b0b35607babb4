"""Evaluate a trained model: loss and perplexity on the eval set, answers to sample prompts, and
benchmark tasks through lm-evaluation-harness. One process, after training, where it ran:

python -m trainer.evaluate --config RUN/trainer_config.json [--champion MODEL_DIR_OR_URI]

The eval set is `eval_dataset` when set, else the training data's held-out split (the same rows
the trainer's eval loss used: same data, seed and eval_fraction; a mixture's measured per source
too). With --champion, that model is
measured on the same eval set and tasks, so promotion compares like with like. Writes
evaluation.json beside model/ in the run's output (a directory or s3://).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from finetune_contract.fields import EVALUATION_FILE
from finetune_contract.parameters import eval_task_names
from trainer.config import TrainConfig, load_config
from trainer.data import IGNORE_INDEX, EvalBatches, build_splits
from trainer.demo import EVAL_TASKS_DIR
from trainer.storage import RunOutput, S3Prefix, is_s3

MODEL_DIR = "model"


def eval_rows(config: TrainConfig) -> datasets.Dataset:
    """The eval set as prepare_data encoded it, unpacked (one example a row, whatever the
    training packed): the eval_dataset's split when set, else the held-out split. Loaded, never
    tokenized here."""
    splits = build_splits(config, unpacked_eval=True)
    if config.eval_dataset and splits.eval_dataset is not None:  # loaded whenever it is set
        return splits.eval_dataset
    return splits.eval


@torch.no_grad()
def loss_on(model: torch.nn.Module, rows: datasets.Dataset, micro_batch: int,
            pad_id: int, device: torch.device) -> float:
    """Mean cross entropy per labelled token (the prompt carries none), as the trainer's."""
    model.eval()
    total, tokens = 0.0, 0
    for batch in EvalBatches(rows, micro_batch, rank=0, world_size=1, pad_id=pad_id):
        batch = batch.to(device)
        logits = model(**batch.model_inputs(), use_cache=False).logits[:, :-1].float()
        labels = batch.labels[:, 1:]
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                 ignore_index=IGNORE_INDEX, reduction="sum").item()
        tokens += int((labels != IGNORE_INDEX).sum())
    return total / max(tokens, 1)


def perplexity(loss: float) -> float | None:
    return math.exp(loss) if loss < 700 else None  # exp overflows past that: no finite value


@torch.no_grad()
def samples(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, rows: datasets.Dataset,
            count: int, max_new_tokens: int, device: torch.device) -> list[dict[str, str]]:
    """The first `count` eval examples: the prompt (as the model sees it), the reference answer
    and the model's greedy answer. A plain-text example's first half is its prompt."""
    out = []
    for row in rows.select(range(min(count, len(rows)))):
        ids, labels = row["input_ids"], row["labels"]
        cut = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), 0)
        cut = cut or max(1, len(ids) // 2)
        prompt = torch.tensor([ids[:cut]], device=device)
        generated = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id
                                   or tokenizer.eos_token_id)
        out.append({
            "prompt": tokenizer.decode(ids[:cut], skip_special_tokens=True),
            "reference": tokenizer.decode(ids[cut:], skip_special_tokens=True),
            "output": tokenizer.decode(generated[0, cut:], skip_special_tokens=True),
        })
    return out


def task_scores(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, names: list[str],
                batch_size: int, device: torch.device) -> tuple[dict, dict]:
    """({task: {metric: value}}, {task: {metric: higher is better}}) from lm-evaluation-harness,
    its tasks found by name in trainer/eval_tasks (offline: their data is shipped there)."""
    if not names:
        return {}, {}
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(device))
    manager = TaskManager(include_path=str(EVAL_TASKS_DIR), include_defaults=False)
    results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager,
                                      log_samples=False, bootstrap_iters=0)
    scores: dict[str, dict[str, float]] = {}
    for task in names:
        scores[task] = {}
        for key, value in results["results"][task].items():
            metric, _, filtered = key.partition(",")
            if not filtered or metric.endswith("_stderr") or not isinstance(value, int | float):
                continue  # alias, sample counts, standard errors
            scores[task][metric if filtered == "none" else f"{metric}/{filtered}"] = value
    better = {task: dict(results.get("higher_is_better", {}).get(task, {})) for task in names}
    return scores, better


def load_model(location: str, work: Path, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """A Hugging Face model directory: a path, file:// URI or s3:// prefix (downloaded)."""
    location = location.removeprefix("file://").rstrip("/")
    if is_s3(location):
        local = work / f"model-{len(list(work.iterdir()))}"
        parent, name = location.rsplit("/", 1)
        S3Prefix(parent).download_tree(name, local)
        location = str(local)
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype).to(device)
    return model, AutoTokenizer.from_pretrained(location)


def pad_id_of(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id


def measure(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, rows: datasets.Dataset,
            config: TrainConfig, device: torch.device) -> dict[str, Any]:
    """Loss, perplexity and task scores of one model on the eval set."""
    loss = loss_on(model, rows, config.micro_batch, pad_id_of(tokenizer), device)
    tasks, better = task_scores(model, tokenizer, eval_task_names(config.eval_tasks),
                                config.micro_batch, device)
    return {"loss": loss, "perplexity": perplexity(loss), "tasks": tasks,
            "higher_is_better": better}


def evaluate(config: TrainConfig, champion: str | None = None) -> dict[str, Any]:
    """Measure the run's model (and the champion's), write evaluation.json, return it."""
    started = time.time()
    torch.manual_seed(config.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and config.mixed_precision == "bf16" \
        else torch.float32
    output = RunOutput(config.output_dir, rank=0)
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="finetune-evaluate-") as tmp:
        work = Path(tmp)
        model_location = f"{config.output_dir.rstrip('/')}/{MODEL_DIR}"
        model, tokenizer = load_model(model_location, work, dtype, device)
        rows = eval_rows(config)
        result = measure(model, tokenizer, rows, config, device)
        by_source = {} if config.eval_dataset else \
            build_splits(config, unpacked_eval=True).eval_by_source()
        result["loss_by_source"] = {
            name: loss_on(model, held_out, config.micro_batch, pad_id_of(tokenizer), device)
            for name, held_out in by_source.items()} or None
        result["samples"] = samples(model, tokenizer, rows, config.sample_prompts,
                                    config.max_new_tokens, device)
        del model
        result["champion"] = None
        try:  # a champion whose model is gone (deleted, moved) is compared by its logged value
            loaded = load_model(champion, work, dtype, device) if champion else None
        except (OSError, ValueError) as exc:
            print(f"champion model {champion} cannot be loaded ({exc}); promote compares "
                  "with its logged metric", flush=True)
            loaded = None
        if loaded is not None and loaded[1].get_vocab() != tokenizer.get_vocab():
            # The prepared eval set holds the run tokenizer's ids: meaningless to this model.
            print(f"champion model {champion} has another tokenizer than the run's; the eval "
                  "set is prepared in the run's tokens, so promote compares with its logged "
                  "metric", flush=True)
            loaded = None
        if loaded is not None:
            champion_model, champion_tokenizer = loaded
            result["champion"] = {"model": champion, **measure(
                champion_model, champion_tokenizer, rows, config, device)}
    result.update({
        "eval_set": config.eval_dataset or "held-out split of the training data",
        "eval_rows": len(rows), "device": device.type,
        "wall_time_s": round(time.time() - started, 1),
    })
    output.dir.mkdir(parents=True, exist_ok=True)
    (output.dir / EVALUATION_FILE).write_text(json.dumps(result, indent=2) + "\n")
    output.sync(EVALUATION_FILE)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trainer.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the run's trainer config (JSON)")
    parser.add_argument("--champion", default=None,
                        help="the champion's model (directory, file:// or s3://) to measure "
                        "on the same eval set")
    args = parser.parse_args(argv)
    result = evaluate(load_config(args.config), args.champion)
    tasks = ", ".join(f"{task} {metric} {value:.3f}" for task, scores in result["tasks"].items()
                      for metric, value in scores.items())
    print(f"evaluation: loss {result['loss']:.4f}, perplexity {result['perplexity']} on "
          f"{result['eval_rows']} rows; {tasks or 'no tasks'}; {len(result['samples'])} samples"
          + (f"; champion loss {result['champion']['loss']:.4f}" if result["champion"] else ""),
          flush=True)


if __name__ == "__main__":
    main()
