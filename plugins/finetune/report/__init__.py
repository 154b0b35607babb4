"""A run's report: a trainer's run directory -> `report.json` and a self-contained `report.html`
(loss, throughput and learning-rate charts, GPU and host metrics, the plan beside what was
measured, evaluation, cost), as collect_metrics and teardown write it and promote amends it.

It runs in the Airflow worker, which has neither torch nor a plotting library: the standard
library, and Jinja2 for the page (finetune.pages); the charts are inline SVG, so the page opens
offline (no scripts, no external resources). Its parts:

- `run_files`: reading the run's files (metrics.jsonl, summary.json, evaluation, hangs);
- `report_json`: assembling report.json (`write_report`, `add_sections`);
- `report_html`: report.html, a view of each section of the report;
- `chart`: the SVG line charts;
- `formats`: numbers as the report and the runs page write them.
"""

from finetune.report.chart import svg_line_chart
from finetune.report.formats import mfu_text
from finetune.report.report_html import render_html
from finetune.report.report_json import add_sections, summarize, write_report
from finetune.report.run_files import (
    METRICS_FILE,
    MODEL_DIR,
    REPORT_HTML,
    REPORT_JSON,
    SUMMARY_FILE,
    load_metrics,
    parse_metrics,
)

__all__ = ["METRICS_FILE", "MODEL_DIR", "REPORT_HTML", "REPORT_JSON", "SUMMARY_FILE",
           "add_sections", "load_metrics", "mfu_text", "parse_metrics", "render_html",
           "summarize", "svg_line_chart", "write_report"]
