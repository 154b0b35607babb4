"""The project's tooling, outside the product: the docs' screenshots, and the real Airflow and
its UI in headless Chromium that the screenshots and the tests both drive.

- `airflow_components`: a real Airflow on this machine (api-server, scheduler, dag-processor,
  triggerer as separate processes), a REST client and a bounded wait.
- `airflow_ui`: Airflow's UI in headless Chromium through the DevTools protocol, and the steps
  through the trigger form.
- `screenshots`: `python -m tools.screenshots` (`make screenshots`): docs/*.png from the real UI
  and a real local run, and docs/screenshots.json, what they show that the code decides.

Run from the repository root with PYTHONPATH=plugins:. (as make sets it). These modules import
plugins/ (`finetune`); nothing in plugins/, trainer/ or dags/ imports them
(tests/plugins/test_package_layout.py), and they are neither in the trainer image nor in its tag.
"""
