"""Benchmarks, outside the product: this trainer beside its peers (`python -m bench.train`, with
torchtitan in `bench.titan` and Unsloth in `bench.unsloth`), the data path
(`python -m bench.prepare_data`), and what the planner is checked against: the measured rows
(`bench.plan_calibration`) and the published shapes of other families (`bench.family_shapes`).

Run from the repository root with PYTHONPATH=plugins:. (as make sets it). Benchmarks import the
trainer and plugins/; nothing in plugins/, trainer/ or dags/ imports them
(tests/plugins/test_package_layout.py), and they are neither in the trainer image nor in its tag
(plugins/finetune/image.py).
"""

# The trainer's set-up before any benchmark imports transformers (trainer/__init__.py).
import trainer  # noqa: F401
