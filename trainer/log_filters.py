"""Drop the log records a user of the trainer would read as errors although they are harmless,
at the loggers that emit them, leaving every other warning of those libraries in place.

- torchao (imported by transformers whenever it is installed) tries to load its optional CUDA
  kernel libraries (`_C_mxfp8...so`, `_C_cutlass_90a...so`) and logs each failure; the float8
  training here (tensorwise scaling, trainer/float8.py) uses none of them.
- torch deprecates register_constant() on Enum subclasses, which torchao calls for its own
  enums at import: a note to torchao's authors, not to the user.
"""

from __future__ import annotations

import logging

_TORCHAO_OPTIONAL_KERNEL = "Failed to load "
_ENUM_REGISTER_CONSTANT = "is an Enum subclass and is now natively supported"


def _optional_kernel_not_loaded(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (message.startswith(_TORCHAO_OPTIONAL_KERNEL) and "/_C" in message
                and ".so" in message)


def _enum_register_constant(record: logging.LogRecord) -> bool:
    return _ENUM_REGISTER_CONSTANT not in str(record.msg)


def install() -> None:
    """Attach the filters (idempotent); before torchao or transformers is imported."""
    for name, keep in (("torchao", _optional_kernel_not_loaded),
                       ("torch.utils._pytree", _enum_register_constant)):
        logger = logging.getLogger(name)
        if keep not in logger.filters:
            logger.addFilter(keep)
