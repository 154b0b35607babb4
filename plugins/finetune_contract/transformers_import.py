"""transformers without scikit-learn's import.

transformers imports scikit-learn whenever it is installed (lm_eval, which the evaluate stage
runs, needs it) for one function of assisted generation (`roc_curve`, the candidate generator's
threshold), which nothing here runs. Measured on 2 cores (2026-12-04): `from transformers import
AutoTokenizer` (validate, prepare_data) 6.4 s instead of 8.6, `import trainer.train` (each
trainer rank) 9.9 s instead of 11.0. Told that
scikit-learn is not there, transformers skips it; lm_eval still imports it where it needs it.
The Airflow side imports transformers' classes from here (`from
finetune_contract.transformers_import import AutoTokenizer`), the trainer calls `skip_sklearn`
in its package's `__init__`; tests/plugins/test_transformers_import.py fails when a module
imports transformers another way, or a transformers release stops honouring this.
"""

from __future__ import annotations

import sys


def skip_sklearn() -> None:
    """Call before the first import of a transformers model or tokenizer class (cheap: it
    imports `transformers.utils`, not torch); too late once transformers' generation is in."""
    if "transformers.generation.candidate_generator" in sys.modules:
        return
    import transformers.utils
    from transformers.utils import import_utils

    def unavailable() -> bool:
        return False

    transformers.utils.is_sklearn_available = unavailable
    import_utils.is_sklearn_available = unavailable


def __getattr__(name: str) -> object:
    """`from finetune_contract.transformers_import import AutoTokenizer`: transformers' own
    class, imported after `skip_sklearn`."""
    skip_sklearn()
    import transformers

    return getattr(transformers, name)
