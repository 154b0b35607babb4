"""The run contract: what a fine-tuning run may ask for, shared by the Airflow side and the trainer.

Torch-free and Airflow-free (standard library only), so both sides import the same code: the
Airflow workers (plugins/, MWAA's plugins.zip) and the trainer image (copied beside trainer/).
A rule lives here once; `validate` runs it before anything is paid for, the trainer at start.

- `parameters`: every run parameter, declared once (type, default, bounds or text rule, choices,
  the form's section and words, the targets and methods it applies to).
- `fields`: the sets of choices, bounds and text rules the parameters name; `ContractError`.
- `train_config`: the trainer's `TrainConfig`, a view of the trainer parameters.
- `presets`: named, versioned settings known to fit a model on an instance type (values only).
- `rules`: rules across fields, as functions returning (field, message) pairs.
- `models`: the built-in model shapes as plain data, and a model directory's shape.
- `families`: the architecture table of the decoder-only families the trainer runs.
- `instance_types`: what each GPU instance type offers (GPUs, EFA, CPU, memory, bandwidth).
- `parallel_dims`: the parallel layout of a world (`ParallelDims`): data-parallel, FSDP shard
  and replicate, and tensor-parallel degrees, the device mesh's dims, their problems.
- `planner`: a run's memory per GPU, step time, wall time and cost, before it is paid for.
- `checkpoint_time`: a checkpoint's size, save and load times, the pods' grace for a notice,
  and whether a spot notice leaves the time.
- `throughput`: FLOPs per token, the GPUs' peaks, a run's tokens/s and MFU.
- `stragglers`: ranks slower than the median by more than a threshold.
- `data`: what a data set and a tokenizer must be, and the encoding of one example, a
  conversation's among them (the one encoding: finetune_data.prepared_set encodes every row
  with it).
- `mixture`: several data sets in one run: the `mixture` parameter's sources, each one's config,
  and the training examples each gives.
- `errors`: the record of a failed training's first cause, per rank.
- `run_history`: each round of a run's training and what happened in it (saves, evals, a
  preemption), and the exit code of a preempted rank.
- `preflight_result`: what the preflight program hands the Airflow side.
- `transformers_import`: transformers imported without what it imports for nothing here.

tests/plugins/test_contract.py fails when a module of the package is not listed here.
"""
