"""The HTML pages the plugin renders (report.html, the runs page): Jinja2 templates in
plugins/finetune/templates/, loaded through the package (so from MWAA's plugins.zip too), every
value escaped unless the code marks it as markup, and an undefined name an error, not a blank."""

from __future__ import annotations

from functools import cache
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup

__all__ = ["Markup", "render"]


@cache
def environment() -> Environment:
    return Environment(loader=PackageLoader("finetune", "templates"), autoescape=True,
                       undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                       keep_trailing_newline=True)


def render(template: str, **context: Any) -> str:
    """The page of `template` (a file name under templates/) filled with `context`."""
    return environment().get_template(template).render(**context)
