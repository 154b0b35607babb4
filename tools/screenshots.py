"""The docs' screenshots, made from the real UI: `python -m tools.screenshots` (`make screenshots`).

It starts Airflow (api-server, scheduler, dag-processor: tools.airflow_components) on this
checkout's DAGs and plugins in a directory of its own, opens llm_finetune's trigger form in
headless Chromium (tools.airflow_ui), runs llm_finetune on the local target (the tiny-local
preset, `RUN_CONF`: a few minutes on 2 CPUs) and captures the runs page while it trains and
after it finished, and its report. It writes `PICTURES` into docs/ and docs/screenshots.json:
what each picture shows that the code decides (the DAG's tasks, the form's sections, the
presets and what each sets, the notes of the fields a preset changes, the runs page's columns,
the report's headline figures and charts), as `screenshots_record()` computes it without a
browser. Before it writes, it checks that the UI showed what the record says.

tests/test_docs.py compares the committed record with `screenshots_record()`: a preset, a stage,
a form section or a column added without making the pictures again fails the fast tests with
"run make screenshots". `--check` makes the same comparison (exit code 1 when stale).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import urllib.parse
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from finetune import REPO_ROOT
from tools.airflow_components import Airflow, wait_for
from tools.airflow_ui import (
    FORM,
    HeadlessChromium,
    log_in,
    open_form_section,
    open_preset_list,
    open_trigger_form,
)

DOCS = REPO_ROOT / "docs"
RECORD = DOCS / "screenshots.json"
DAG_ID = "llm_finetune"
PICTURES = ("trigger-form.png", "trigger-form-presets.png", "trigger-form-fields.png",
            "runs-page-running.png", "runs-page.png", "report.png")
# trigger-form-fields.png: the Training section from its first field to warmup_steps, each with
# the values the presets give it.
FIELDS_SECTION, FIELDS_SHOWN = "Training", ("seq_len", "warmup_steps")
# The run the runs page and the report show: tiny-local, few steps, an eval every 50 so the loss
# chart has points. On 2 cores its 200 steps took 17 s (the whole run about a minute) when
# quiet, 65 s (4 minutes) when other work shared them: long enough to be pictured training.
RUN_CONF = {"preset": "tiny-local", "max_steps": 200, "eval_interval": 50}
# runs-page-running.png is taken once the run has trained this share of its steps.
RUNNING_AT = 0.4
WIDTH = 1400  # CSS pixels of the browser's window (scale 1: a picture's pixels are CSS pixels)
MARGIN = 16  # around a cropped element


class ScreenshotError(Exception):
    """A picture could not be made as the record says: the UI showed something else, or the
    run it shows failed."""


# -- the record: what the pictures show that the code decides ------------------------------------

def screenshots_record() -> dict[str, dict[str, Any]]:
    """picture name -> what it shows that the code decides; no browser, no Airflow server."""
    from finetune.demo import load_dag
    from finetune.params import dag_params
    from finetune_contract.parameters import FORM_PARAMETERS
    from finetune_contract.presets import PRESET_DISPLAY, PRESET_NAMES

    params = dag_params()
    columns, figures, charts = example_run_pages()
    return {
        "trigger-form.png": {
            "tasks": sorted(load_dag(DAG_ID).task_ids),
            "sections": list(dict.fromkeys(p.section for p in FORM_PARAMETERS)),
            "presets": [PRESET_DISPLAY[name] for name in PRESET_NAMES],
        },
        "trigger-form-presets.png": {
            "description": params["preset"].schema["description_md"].splitlines(),
        },
        "trigger-form-fields.png": {
            "section": FIELDS_SECTION,
            "fields": {params[name].schema["title"]: params[name].description
                       for name in fields_shown()},
        },
        "runs-page-running.png": {"columns": columns},
        "runs-page.png": {"columns": columns},
        "report.png": {"figures": figures, "charts": charts},
    }


def fields_shown() -> list[str]:
    """The fields of trigger-form-fields.png, in the form's order: FIELDS_SHOWN's first to last."""
    from finetune_contract.parameters import FORM_PARAMETERS

    names = [p.name for p in FORM_PARAMETERS if p.section == FIELDS_SECTION]
    first, last = FIELDS_SHOWN
    return names[names.index(first):names.index(last) + 1]


def example_run_pages() -> tuple[list[str], list[str], list[str]]:
    """The runs page's columns, the report's headline figures and its charts, as the product
    renders them for a finished local run (a small one made up here, as a real one writes
    metrics.jsonl and summary.json)."""
    from finetune.report import write_report
    from finetune.runs_page import list_runs, render_runs_table

    with tempfile.TemporaryDirectory(prefix="screenshots-record-") as tmp:
        run_dir = Path(tmp, "manual__example")
        run_dir.mkdir()
        records = [{"type": "eval", "step": 0, "eval_loss": 6.5, "time": 0.0}]
        records += [{"type": "train", "step": s, "loss": 6.0 - s / 10, "lr": 3e-3,
                     "grad_norm": 1.0, "tokens": 1536, "tokens_per_s": 3000.0,
                     "tflops_per_device": 0.01, "mfu": None, "step_time_s": 0.5,
                     "time": float(s)} for s in range(1, 5)]
        records += [{"type": "eval", "step": 4, "eval_loss": 5.0, "time": 5.0}]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (run_dir / "summary.json").write_text(json.dumps({
            "initial_eval_loss": 6.5, "final_eval_loss": 5.0, "steps": 4, "world_size": 2}))
        write_report(run_dir, run_id="manual__example", status="success",
                     config={"target": "local", "model": "tiny-llama", "nodes": 1,
                             "procs_per_node": 2})
        columns = PageFacts.of(render_runs_table(list_runs([Path(tmp)]))).columns
        report = PageFacts.of((run_dir / "report.html").read_text())
    return columns, report.figures, report.charts


class PageFacts(HTMLParser):
    """What the pictures show of this project's own pages, read from their HTML: the table
    headings (on the runs page: its columns), the runs' statuses, the report's headline figure
    labels and the titles of the charts at its top (the training's; GPU and host charts come
    further down)."""

    def __init__(self) -> None:
        super().__init__()
        self.columns: list[str] = []
        self.statuses: list[str] = []
        self.figures: list[str] = []
        self.charts: list[str] = []
        self._text: list[str] | None = None  # the list whose last item the text goes to
        self._in_charts = False
        self._charts_seen = False

    @classmethod
    def of(cls, html: str) -> PageFacts:
        facts = cls()
        facts.feed(html)
        facts.close()
        return facts

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        classes = (attributes.get("class") or "").split()
        if tag == "section":
            self._in_charts = "charts" in classes and not self._charts_seen
            self._charts_seen |= "charts" in classes
        elif tag == "svg" and self._in_charts:
            self.charts.append(attributes.get("aria-label") or "")
        elif tag == "th" or (tag == "div" and "label" in classes) or (
                tag == "span" and "status" in classes):
            self._text = {"th": self.columns, "div": self.figures, "span": self.statuses}[tag]
            self._text.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("th", "div", "span"):
            self._text = None
        elif tag == "section":
            self._in_charts = False

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text[-1] = " ".join(f"{self._text[-1]} {data}".split())


def stale_pictures(committed: dict, current: dict) -> list[str]:
    """The pictures whose record differs, each as "name (what differs)"."""
    stale = []
    for name in dict.fromkeys([*committed, *current]):
        was, now = committed.get(name), current.get(name)
        if was == now:
            continue
        if was is None or now is None:
            stale.append(f"{name} ({'new' if was is None else 'no longer made'})")
        else:
            differ = [key for key in dict.fromkeys([*was, *now]) if was.get(key) != now.get(key)]
            stale.append(f"{name} ({', '.join(differ)})")
    return stale


def stale_message(stale: list[str]) -> str:
    return ("docs/screenshots.json is not what the docs' pictures would show now: "
            f"{'; '.join(stale)}: run `make screenshots` and commit docs/*.png and "
            "docs/screenshots.json")


# -- the pictures ----------------------------------------------------------------------------------

def expect(what: str, shown: Any, recorded: Any) -> None:
    if shown != recorded:
        raise ScreenshotError(f"{what}: the UI shows {shown!r}, the record says {recorded!r}")


def element_box(browser: HeadlessChromium, selector: str, index: int = 0) -> dict[str, float]:
    """The page box of the `index`th visible element matching `selector` (CSS pixels)."""
    box = browser.js(
        f"(() => {{ const e = [...document.querySelectorAll({json.dumps(selector)})].filter("
        f"e => e.getClientRects().length)[{index}]; if (!e) return null; "
        "const r = e.getBoundingClientRect(); return {x: r.x + scrollX, y: r.y + scrollY, "
        "width: r.width, height: r.height}; })()")
    if box is None:
        raise ScreenshotError(f"nothing on the page matches {selector!r}")
    return box


def resize(browser: HeadlessChromium, width: int, height: int) -> None:
    browser.cdp("Emulation.setDeviceMetricsOverride", width=width, height=int(height),
                deviceScaleFactor=1, mobile=False)
    time.sleep(0.5)


def fit_height(browser: HeadlessChromium, width: int, selector: str) -> None:
    """A window tall enough that the element matching `selector` has no scrolled part."""
    box = element_box(browser, selector)
    resize(browser, width, box["y"] + box["height"] + 4 * MARGIN)


def around(box: dict[str, float], top: float | None = None, bottom: float | None = None,
           margin: float = MARGIN) -> dict[str, float]:
    """A clip around `box` (from `top` to `bottom` when given), `margin` wider on each side."""
    top = box["y"] if top is None else top
    bottom = box["y"] + box["height"] if bottom is None else bottom
    return {"x": max(0.0, box["x"] - margin), "y": max(0.0, top - margin),
            "width": box["width"] + 2 * margin, "height": bottom - top + 2 * margin}


def trigger_form_pictures(browser: HeadlessChromium, url: str, record: dict,
                          logs: Path) -> dict[str, bytes]:
    """The form with the preset list open (the DAG's tasks behind it), the preset field's
    description, and the fields a preset changes."""
    pictures: dict[str, bytes] = {}
    shown = record["trigger-form.png"]
    resize(browser, WIDTH, 1400)
    open_trigger_form(browser, url, DAG_ID, logs)
    tasks = browser.js(f"[...document.querySelectorAll('a[href*=\"/dags/{DAG_ID}/tasks/\"]')]"
                       ".map(a => decodeURIComponent(a.pathname.split('/').pop()))")
    expect("the grid's tasks", sorted(set(tasks)), shown["tasks"])
    sections = browser.js(f"[...document.querySelectorAll('{FORM} [data-scope=accordion]"
                          "[data-part=item-trigger]')].map(b => b.innerText.trim())")
    expect("the form's sections", [s for s in sections if s != "Advanced Options"],
           shown["sections"])

    open_form_section(browser, shown["sections"][0])  # Preset
    fit_height(browser, WIDTH, FORM)
    preset_field = f"{FORM} [data-part=item][data-state=open]"
    described = browser.js(f"document.querySelector('{preset_field}').innerText")
    recorded = [line.split("`")[1] for line in record["trigger-form-presets.png"]["description"]
                if line.startswith("- `")]
    expect("the presets the preset field describes",
           [name for name in recorded if f"{name}:" in described], recorded)
    pictures["trigger-form-presets.png"] = browser.screenshot(
        around(element_box(browser, preset_field)))

    presets = open_preset_list(browser)
    expect("the preset list", presets, shown["presets"])
    # The list scrolls past its tenth option: lifted so the picture shows every preset.
    browser.js("document.querySelectorAll('[role=listbox]').forEach(l => "
               "l.style.maxHeight = 'none')")
    time.sleep(0.3)
    form = element_box(browser, FORM)
    pictures["trigger-form.png"] = browser.screenshot(
        {"x": 0, "y": 0, "width": WIDTH, "height": form["y"] + form["height"] + 2 * MARGIN})

    fields = record["trigger-form-fields.png"]
    open_form_section(browser, fields["section"])
    fit_height(browser, WIDTH, FORM)
    rows = f"{FORM} [data-part=item][data-state=open] [data-scope=field][data-part=root]"
    titles = browser.js(f"[...document.querySelectorAll('{rows}')].map(r => "
                        "r.querySelector('label').innerText.replace('*', '').trim())")
    first = titles.index(next(iter(fields["fields"])))
    count = len(fields["fields"])
    expect("the fields pictured", titles[first:first + count], list(fields["fields"]))
    notes = browser.js(f"[...document.querySelectorAll('{rows}')].slice({first}, "
                       f"{first + count}).map(r => r.innerText)")
    for (title, description), note in zip(fields["fields"].items(), notes, strict=True):
        if " ".join(description.split()) not in " ".join(note.split()):
            raise ScreenshotError(f"the form shows {title} as {note!r}, the record says "
                                  f"{description!r}")
    section = element_box(browser, f"{FORM} [data-part=item][data-state=open]")
    last = element_box(browser, rows, first + count - 1)
    pictures["trigger-form-fields.png"] = browser.screenshot(
        around(section, bottom=last["y"] + last["height"]))
    return pictures


def runs_page_picture(browser: HeadlessChromium, url: str, columns: list[str], status: str,
                      logs: Path) -> bytes:
    """The "Fine-tuning runs" page in Airflow's UI (the plugin's page in an iframe), as wide
    as its table and as tall as its rows, its one run in `status`."""
    resize(browser, WIDTH, 900)
    browser.go(f"{url}/plugin/finetune-runs")
    frame = "document.querySelector('iframe')"
    wait_for("the runs page", lambda: browser.js(
        f"!!({frame} && {frame}.contentDocument && "
        f"{frame}.contentDocument.querySelector('tr.run'))"), 60, logs, interval=0.5)
    overflow = browser.js(f"(() => {{ const w = {frame}.contentDocument.querySelector("
                          "'.table-wrap'); return w.scrollWidth - w.clientWidth; })()")
    if overflow > 0:  # the table scrolls sideways: widen the window until it does not
        resize(browser, WIDTH + overflow + MARGIN, 900)
    html = browser.js(f"{frame}.contentDocument.documentElement.outerHTML")
    facts = PageFacts.of(html)
    expect("the runs page's columns", facts.columns, columns)
    expect("the run's status on the runs page", facts.statuses, [status])
    bottom = browser.js(f"(() => {{ const f = {frame}.getBoundingClientRect(); const t = "
                        f"{frame}.contentDocument.querySelector('table')"
                        ".getBoundingClientRect(); return f.y + t.bottom; })()")
    width = browser.js("innerWidth")
    return browser.screenshot({"x": 0, "y": 0, "width": width, "height": bottom + 2 * MARGIN})


def report_picture(browser: HeadlessChromium, url: str, name: str, shown: dict,
                   logs: Path) -> bytes:
    """The top of the run's report: its headline figures and its charts."""
    resize(browser, WIDTH, 900)
    browser.go(f"{url}/finetune-runs/runs/{urllib.parse.quote(name)}/report.html")
    wait_for("the report", lambda: browser.js("!!document.querySelector('section.charts svg')"),
             60, logs, interval=0.5)
    facts = PageFacts.of(browser.js("document.documentElement.outerHTML"))
    expect("the report's headline figures", facts.figures, shown["figures"])
    expect("the report's charts", facts.charts, shown["charts"])
    content = element_box(browser, "section.figures")  # as wide as the page's text
    charts = element_box(browser, "section.charts")
    return browser.screenshot({"x": content["x"] - 2 * MARGIN, "y": 0,
                               "width": content["width"] + 4 * MARGIN,
                               "height": charts["y"] + charts["height"] + MARGIN})


def run_pictures(browser: HeadlessChromium, airflow: Airflow, runs: Path,
                 record: dict) -> dict[str, bytes]:
    """Run llm_finetune (RUN_CONF) and take the runs page while it trains, after it ends, and
    its report."""
    api, logs = airflow.api, airflow.home
    status, run = api.call("POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {
        "logical_date": None, "conf": {**RUN_CONF, "output_dir": str(runs)}})
    if status != 200:
        raise ScreenshotError(f"triggering {DAG_ID}: HTTP {status} {run}")
    run_path = f"/api/v2/dags/{DAG_ID}/dagRuns/{urllib.parse.quote(run['dag_run_id'], safe='')}"
    print(f"training: {DAG_ID} run {run['dag_run_id']} ({RUN_CONF})", flush=True)

    def training_row() -> dict | None:
        """The run's row on the runs page once it trained RUNNING_AT of its steps (or ended)."""
        if api.get(run_path)["state"] == "failed":
            raise ScreenshotError(f"the run failed; the components' logs are in {logs}")
        status, rows = api.call("GET", "/finetune-runs/api/runs")
        row = rows[0] if status == 200 and rows else None
        step = ((row or {}).get("progress") or {}).get("step") or 0
        ended = row is not None and row["status"] != "running"
        return row if ended or step >= RUNNING_AT * RUN_CONF["max_steps"] else None

    row = wait_for("the run to train", training_row, 600, logs, interval=0.5)
    if row["status"] != "running":
        raise ScreenshotError(f"the run had ended ({row['status']}) before it could be "
                              "pictured training: raise RUN_CONF's max_steps")
    pictures = {"runs-page-running.png": runs_page_picture(
        browser, airflow.url, record["runs-page-running.png"]["columns"], "running", logs)}

    def final_state() -> str | None:
        state = api.get(run_path)["state"]
        return state if state in ("success", "failed") else None

    state = wait_for("the run to end", final_state, 900, logs, interval=2)
    if state != "success":
        raise ScreenshotError(f"the run {state}; the components' logs are in {logs}")
    pictures["runs-page.png"] = runs_page_picture(
        browser, airflow.url, record["runs-page.png"]["columns"], "success", logs)
    pictures["report.png"] = report_picture(browser, airflow.url, row["name"],
                                            record["report.png"], logs)
    return pictures


def chromium_binary() -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        raise SystemExit("chromium is not installed: apt-get install chromium "
                         "(or make system-deps as root)")
    return binary


def make_screenshots(record: dict, work: Path) -> dict[str, bytes]:
    """Every picture of PICTURES, checked against `record`; Airflow's files under `work`."""
    chromium = chromium_binary()
    home, runs = work / "airflow", work / "runs"
    home.mkdir()
    airflow = Airflow(home, {"AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
                             "AIRFLOW__FINETUNE__RUNS_DIRS": str(runs)})
    try:
        airflow.start("api-server", "scheduler", "dag-processor")
        airflow.wait_for_dags(DAG_ID)
        status, dag = airflow.api.call("PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": False})
        if status != 200:
            raise ScreenshotError(f"unpausing {DAG_ID}: HTTP {status} {dag}")
        with HeadlessChromium(chromium, work / "chromium", WIDTH, 900) as browser:
            log_in(browser, airflow.url, airflow.api.token)
            pictures = trigger_form_pictures(browser, airflow.url, record, home)
            pictures |= run_pictures(browser, airflow, runs, record)
    finally:
        airflow.stop()
    return {name: pictures[name] for name in PICTURES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only compare docs/screenshots.json with what the code shows now")
    args = parser.parse_args(argv)
    current = screenshots_record()
    committed = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    if args.check:
        stale = stale_pictures(committed, current)
        if stale:
            print(stale_message(stale), file=sys.stderr)
        return 1 if stale else 0

    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="finetune-screenshots-"))
    try:
        pictures = make_screenshots(current, work)
    except (ScreenshotError, TimeoutError) as failure:
        print(f"no pictures written: {failure}\n(Airflow's files and logs: {work})",
              file=sys.stderr)
        return 1
    for name, png in pictures.items():
        (DOCS / name).write_bytes(png)
        print(f"docs/{name}")
    RECORD.write_text(json.dumps(current, indent=2, ensure_ascii=False) + "\n")
    print(f"docs/{RECORD.name}: what they show; {time.monotonic() - started:.0f} s")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
