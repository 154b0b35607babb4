"""The `local` target as a package of parts, this machine being the cluster:

- `target`: `LocalTarget`, the stages the DAG calls;
- `machine`: this machine's CPUs and GPUs, what a run gets of them, the environment of the
  processes a stage starts, where a run directory can be made;
- `training`: the torchrun agents, one per node: started, followed, restarted, reattached to;
- `processes`: the training's processes through psutil (found by the run's config, alive,
  told from a reused pid, stopped);
- `state`: the records in <run_dir>/state/ that later tasks and retries read.
"""
