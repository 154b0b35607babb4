"""Plan a run before paying for it: memory per GPU, step time, wall time and cost of a conf.

    python -m finetune.plan_cli --conf conf.json [--set micro_batch=8 ...] [--search] [--scaling]
    make plan CONF='{"preset": "llama2-70b-p5"}' ARGS=--search

The figures are finetune.run_plan's; validate logs the same and refuses a run whose estimated
peak exceeds the GPU's memory. Exit code 0: it fits; 1: it does not; 2: the conf is invalid.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from finetune.cli import parse_set
from finetune.config import ConfigError
from finetune.run_plan import model_config_of, plan_run, plan_text, scaling_rows, search_text
from finetune.trainer_config import trainer_config
from finetune.validate import validate_params
from finetune_contract.instance_types import INSTANCE_TYPES
from finetune_contract.train_config import TrainConfig


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetune.plan_cli", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conf", default="{}",
                        help="the run's conf as for a trigger: a JSON file, or JSON itself")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--search", action="store_true", help="list the fastest that fit")
    parser.add_argument("--scaling", action="store_true",
                        help="predicted tokens/s per GPU at 1-128 nodes of the instance type")
    args = parser.parse_args(argv)
    path = Path(args.conf)
    conf: dict[str, Any] = json.loads(path.read_text() if path.is_file() else args.conf)
    conf.update(parse_set(args.set))
    try:
        cfg = validate_params(conf, run_id="plan", given=conf, plan_only=True)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    train = TrainConfig(**trainer_config(cfg))
    plan = plan_run(cfg, train)
    print(plan_text(cfg, plan))
    fits = plan.estimate.fits is not False
    if args.search or not fits:
        print(search_text(cfg, train))
    if args.scaling and cfg.instance_type in INSTANCE_TYPES:
        print(f"scaling on {cfg.instance_type} (a model, not a measurement):")
        for n, rate, eff in scaling_rows(plan.train,
                                         INSTANCE_TYPES[cfg.instance_type],
                                         model_config_of(cfg.model)):
            print(f"  {n:>4} nodes  {rate:>9,.0f} tokens/s per GPU  {eff:6.1%}")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
