"""The run contract: what a fine-tuning run may ask for, shared by the Airflow side and the trainer.

Torch-free and Airflow-free (standard library only), so both sides import the same code: the
Airflow workers (plugins/, MWAA's plugins.zip) and the trainer image (copied beside trainer/).
A rule lives here once; `validate` runs it before anything is paid for, the trainer at start.

- `fields`: the choices and bounds of every field, the trainer's `TrainConfig`, `ContractError`.
- `models`: the built-in model shapes as plain data, and a model directory's shape.
- `parallel_dims`: the parallel layout of a world (`ParallelDims`): data-parallel, FSDP shard and
  replicate, and tensor-parallel degrees, the device mesh's dims, their problems.
- `rules`: cross-field rules (precision, checkpointing, float8, LoRA, sharding, tensor
  parallelism, sequence length, s3:// URIs, paths) as functions returning (field, message) pairs.
- `data`: what can be known of a data set and a tokenizer from their files, and the encoding of
  one example (the one encoding: finetune_data.prepared_set encodes every row with it).
"""
