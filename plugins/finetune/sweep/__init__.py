"""Sweeps: many parameterized runs as one DAG run (the llm_finetune_sweep DAG), on the single
run's stages: a search space of trials, each validated as a run; data prepared once per
prepared-data group; one scale-up for the trials run at once; an early-stopping rule; the best
trial evaluated and promoted as a single run's model is. Its parts:

- `space`: the search space (grid, list of confs, random samples with a seed) -> each trial's
  values;
- `trials`: the sweep's conf -> every trial's validated run config and the sweep's own
  (`validate_sweep`); the planner's figures of each trial;
- `asha`: the early-stopping rule (successive halving), pure;
- `records`: what the trials leave in the sweep's directory for each other and for a retry
  (rung records, outcomes, rendezvous);
- `early_stop`: a trial's training followed for the rule (`RungWatch`), which the targets'
  train stage asks;
- `reports`: each trial's report, the winner, MLflow's parent and child runs, the sweep's
  report;
- `pipeline`: the task graph (`sweep_pipeline`) and its doc.
"""
