"""transformers without the packages it imports for nothing here.

transformers imports some packages whenever they are installed, for features nothing here uses
(`UNUSED`, below). Told that they are not there, transformers skips them; what needs them
imports them itself (lm_eval scikit-learn, the trainer's float8 and QLoRA torchao). Measured on
2 cores (2026-12-04), each import three times: `import trainer.train` (each trainer rank's
start) 8.9 s against 10.0 with scikit-learn skipped alone (11.0 with none skipped); `from
transformers import AutoTokenizer` (validate, prepare_data) 6.4 s instead of 8.6.
The Airflow side imports transformers' classes from here (`from
finetune_contract.transformers_import import AutoTokenizer`), the trainer calls `skip_unused`
in its package's `__init__`; tests/plugins/test_transformers_import.py fails when a module
imports transformers another way, or a transformers release stops honouring this.
"""

from __future__ import annotations

import sys

# Installed for other processes, used by nothing transformers does here. What each cost a
# trainer rank's import (python -X importtime, 2 cores, 2026-12-04): scikit-learn 1.1 s (one
# function of assisted generation), SciPy 0.7 s (the object-detection losses), torchao 0.7 s
# (its quantizer, for torchao-quantized checkpoints).
UNUSED = ("sklearn", "scipy", "torchao")


def skip_unused() -> None:
    """Call before the first import of a transformers model or tokenizer class (cheap: it
    imports `transformers.utils`, not torch); too late once transformers' modules are in."""
    if "transformers.modeling_utils" in sys.modules:
        return
    import transformers.utils
    from transformers.utils import import_utils

    def unavailable(*args: object, **kwargs: object) -> bool:
        return False

    for package in UNUSED:
        setattr(transformers.utils, f"is_{package}_available", unavailable)
        setattr(import_utils, f"is_{package}_available", unavailable)


def __getattr__(name: str) -> object:
    """`from finetune_contract.transformers_import import AutoTokenizer`: transformers' own
    class, imported after `skip_unused`."""
    skip_unused()
    import transformers

    return getattr(transformers, name)
