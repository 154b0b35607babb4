"""Airflow plugin: the "Fine-tuning runs" page (finetune/runs_page.py) in the UI's navigation."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from finetune.runs_page import URL_PREFIX, create_app


class FinetuneRunsPlugin(AirflowPlugin):
    name = "finetune_runs"
    fastapi_apps = [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "Fine-tuning runs"}]
    # Shown in the UI's navigation, the page in an iframe; href relative to the UI's base URL.
    external_views = [{"name": "Fine-tuning runs", "href": f"{URL_PREFIX.lstrip('/')}/",
                       "url_route": "finetune-runs", "destination": "nav",
                       "category": "browse"}]
