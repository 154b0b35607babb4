"""FSDP2 fine-tuning of Llama-class causal LMs, run by torchrun; see trainer/train.py.

The trainer imports the run contract (`finetune_contract`, torch-free), the package the Airflow
side validates with. The image copies it beside trainer/; in a checkout it is in plugins/, put
on the path here so that torchrun workers, tests and benchmarks need no PYTHONPATH of their own.

Harmless import-time log records of torchao and torch are filtered here, before any trainer
module imports transformers: trainer/log_filters.py. So are transformers' imports of
scikit-learn, SciPy and torchao, used by nothing here, 2.1 s of each rank's start on 2 cores
(finetune_contract/transformers_import.py; it costs the package `transformers.utils`, 0.65 s,
also in processes that need no model, such as the preflight's).
"""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("finetune_contract") is None:
    _plugins = Path(__file__).resolve().parents[1] / "plugins"
    if (_plugins / "finetune_contract").is_dir():
        sys.path.append(str(_plugins))

from trainer import log_filters

log_filters.install()

from finetune_contract.transformers_import import skip_unused  # noqa: E402

skip_unused()
