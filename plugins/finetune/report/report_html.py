"""report.html: the report dict -> one self-contained page (templates/report.html.j2, rendered
by finetune.pages), each section turned into the rows, tables and charts the template shows.
No scripts and no external resources: the page opens offline.
"""

from __future__ import annotations

import json
from typing import Any

from finetune.pages import render
from finetune.report.chart import svg_line_chart
from finetune.report.formats import GIB, fmt, fmt_bytes, fmt_duration, mfu_text
from finetune.report.run_files import finite


def render_html(report: dict) -> str:
    """The report dict -> one self-contained HTML page (templates/report.html.j2)."""
    train, evals = report["series"]["train"], report["series"]["eval"]
    charts = [
        svg_line_chart({"train loss": _points(train, "step", "loss"),
                        "eval loss": _points(evals, "step", "eval_loss")},
                       "Loss", "step", "loss"),
        svg_line_chart({"tokens/s": _points(train, "step", "tokens_per_s")},
                       "Throughput", "step", "tokens/s"),
        svg_line_chart({"lr": _points(train, "step", "lr")}, "Learning rate", "step", "lr"),
    ]
    by_source = [r for r in evals if r.get("eval_loss_by_source")]
    if by_source:  # a mixture
        names = list(dict.fromkeys(name for r in by_source for name in r["eval_loss_by_source"]))
        charts.append(svg_line_chart(
            {name: [(r["step"], r["eval_loss_by_source"][name]) for r in by_source
                    if r["eval_loss_by_source"].get(name) is not None] for name in names},
            "Eval loss per source", "step", "loss"))
    if any(r.get("reward_accuracy") is not None for r in train):  # a dpo run
        charts.append(svg_line_chart(
            {"reward accuracy": _points(train, "step", "reward_accuracy"),
             "reward margin": _points(train, "step", "reward_margin")},
            "Preference rewards (DPO)", "step", "value"))
    cost = report.get("cost")
    return render(
        "report.html.j2",
        run_id=report["run_id"],
        status=report["status"],
        generated_at=report["generated_at"],
        error=_error_view(report.get("error")),
        figures=_headline_figures(report["metrics"]) + _gpu_headlines(report.get("gpu")),
        charts=charts,
        config=_flatten(report["config"]),
        evaluation=_evaluation_view(report.get("evaluation"), report.get("promotion"),
                                    report.get("tracking")),
        data=_data_view(report.get("data"), report.get("eval_loss_by_source")),
        cost=cost and {"nodes": cost["nodes"], "price": f"{cost['node_hourly_price_usd']:g}",
                       "hours": f"{cost['hours']:.2f}", "usd": f"{cost['usd']:,.2f}"},
        gpu=_gpu_view(report.get("gpu")),
        plan=_plan_view(report.get("plan")),
        goodput=_goodput_view(report.get("goodput")),
        host=_host_view(report.get("host")),
        ranks=_rank_times_view(report.get("rank_step_times")),
        preflight=_preflight_view(report.get("preflight")),
        stages=_flatten(report["stages"]),
        artifacts=[(k, "n/a" if v is None else v) for k, v in report["artifacts"].items()],
        warnings=report["warnings"],
    )


def _headline_figures(metrics: dict) -> list[tuple[str, str]]:
    loss = (
        f"{fmt(metrics.get('initial_eval_loss'), '.4f')} → "
        f"{fmt(metrics.get('final_eval_loss'), '.4f')}"
    )
    return [
        ("tokens/s (total tokens / step time)", fmt(metrics.get("tokens_per_s"), ",.0f")),
        ("median step", fmt(metrics.get("median_step_time_s"), ".3g", " s")),
        ("TFLOPs/device", fmt(metrics.get("tflops_per_device"), ".4g")),
        ("MFU", mfu_text(metrics)),
        ("wall time", fmt_duration(metrics.get("wall_time_s"))),
        ("peak memory", fmt_bytes(metrics.get("peak_memory_bytes"))),
        ("eval loss", loss),
        ("steps", fmt(metrics.get("steps"), ",.0f")),
        ("world size", fmt(metrics.get("world_size"), ".0f")),
        ("cost estimate", fmt(metrics.get("cost_usd"), ",.2f", " USD")),
    ]


def _gpu_headlines(gpu: dict | None) -> list[tuple[str, str]]:
    if not gpu or not gpu.get("available"):
        return []
    util = [n["metrics"].get("gpu_util_pct", {}) for n in gpu["nodes"]]
    means = [u.get("mean") for u in util if finite(u.get("mean")) is not None]
    weights = [n["gpus"] for n, u in zip(gpu["nodes"], util, strict=True)
               if finite(u.get("mean")) is not None]
    mean = sum(m * w for m, w in zip(means, weights, strict=True)) / sum(weights) \
        if weights else None
    return [("GPU util (mean)", fmt(mean, ".1f", "%")),
            ("GPUs", str(len(gpu["gpus"]))),
            ("XID errors", str(len(gpu["xid_errors"])))]


def _flatten(mapping: dict, prefix: str = "") -> list[tuple[str, str]]:
    """Nested dict -> [(dotted key, value text)] so nested config reads as one table."""
    rows: list[tuple[str, str]] = []
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            rows.extend(_flatten(value, f"{name}."))
        elif isinstance(value, str):
            rows.append((name, value))
        else:
            rows.append((name, json.dumps(value, default=str)))
    return rows


def _points(records: list[dict], x_key: str, y_key: str) -> list[tuple[float, float]]:
    return [(r[x_key], r[y_key]) for r in records if r.get(y_key) is not None]


def _error_view(error: dict | None) -> dict | None:
    if not error:
        return None
    where = f"stage {error['stage']}" + (f", rank {error['rank']}" if error.get("rank") is not
                                          None else "")
    return {"where": where, "type": error["type"], "message": error["message"]}


def _plan_view(plan: dict | None) -> dict | None:
    if not plan:
        return None
    rows = [(key, f"{fmt(row['estimate'], '.4g')} estimated, {fmt(row['measured'], '.4g')} "
                  f"measured" + (f" ({row['error']:+.1%})" if row["error"] is not None else ""))
            for key, row in plan["compared"].items()]
    return {"rows": rows, "notes": plan.get("notes") or []}


def _goodput_view(goodput: dict | None) -> dict | None:
    """Where the paid node time went, a row a category; each interruption and its cost."""
    if not goodput:
        return None
    paid = goodput["paid_node_s"] or 1.0
    cost = goodput.get("cost_usd") or {}
    rows = [(name.replace("_", " "), f"{fmt(seconds, ',.1f')} node-s ({seconds / paid:.1%})"
             + (f", {fmt(cost.get(name), ',.2f')} USD" if cost else ""))
            for name, seconds in goodput["node_s"].items()]
    interruptions = [(f"{x['kind']} at step {x['step']}"
                      + (" (a round's start-up, before its first step)"
                         if x.get("before_first_step") else ""),
                      f"{x['steps_lost']} step(s) trained again, {fmt(x['node_seconds'], ',.1f')}"
                      " node-s until it trained again") for x in goodput["interruptions"]]
    return {"headline": f"{goodput['goodput']:.1%} of {fmt(paid, ',.0f')} paid node-seconds "
                        f"trained" + (f" ({fmt(cost.get('paid'), ',.2f')} USD paid)"
                                      if cost else ""),
            "rows": rows, "interruptions": interruptions}


def _evaluation_view(evaluation: dict | None, promotion: dict | None,
                     tracking: dict | None) -> dict | None:
    if not evaluation:
        return None
    champion = evaluation.get("champion") or {}
    rows = [("eval set", f"{evaluation.get('eval_set')} ({evaluation.get('eval_rows')} rows)"),
            ("loss", fmt(evaluation.get("loss"), ".4f")
             + (f" (champion {fmt(champion.get('loss'), '.4f')})" if champion else "")),
            *[(f"loss on {name}", fmt(loss, ".4f"))
              for name, loss in (evaluation.get("loss_by_source") or {}).items()],
            ("perplexity", fmt(evaluation.get("perplexity"), ".3f")
             + (f" (champion {fmt(champion.get('perplexity'), '.3f')})" if champion else ""))]
    for task, scores in (evaluation.get("tasks") or {}).items():
        theirs = (champion.get("tasks") or {}).get(task, {})
        for metric, value in scores.items():
            rows.append((f"{task} {metric}", fmt(value, ".4f") + (
                f" (champion {fmt(theirs.get(metric), '.4f')})" if metric in theirs else "")))
    return {
        "rows": rows,
        "promotion": promotion and {
            "decision": promotion.get("decision"), "metric": promotion.get("metric"),
            "challenger": fmt(promotion.get("challenger"), ".4f"),
            "champion": fmt(promotion.get("champion"), ".4f"),
            "margin": fmt(promotion.get("margin"), "g"), "reason": promotion.get("reason", "")},
        "tracking": tracking if tracking and tracking.get("run_id") else None,
        "samples": evaluation.get("samples") or [],
    }


_GPU_COLUMNS = (("gpu_util_pct", "GPU util", "%"), ("mem_copy_util_pct", "mem copy util", "%"),
                ("sm_clock_mhz", "SM clock", "MHz"), ("fb_used_mib", "FB used", "MiB"),
                ("power_w", "power", "W"), ("temperature_c", "temperature", "°C"))
_GPU_PLOTS = (("gpu_util_pct", "GPU utilisation", "%"), ("fb_used_mib", "GPU memory used", "MiB"),
              ("power_w", "GPU power", "W"), ("temperature_c", "GPU temperature", "°C"))
_MAX_PLOTTED_GPUS = 32


def _gpu_rows(rows: list[dict], key_cols: tuple[str, ...]) -> list[list[Any]]:
    """One row of cells per node or GPU: its keys, then each column's mean / max."""
    return [[row.get(c) for c in key_cols] + [
        f"{fmt(stat.get('mean'), ',.1f')} / {fmt(stat.get('max'), ',.1f')}"
        for stat in (row["metrics"].get(key) or {} for key, _, _ in _GPU_COLUMNS)]
        for row in rows]


def _gpu_view(gpu: dict | None) -> dict | None:
    if not gpu:
        return None
    view: dict[str, Any] = {"xid_errors": [
        {"node": e["node"], "gpu": e["gpu"], "pods": ", ".join(e["pods"]) or "n/a",
         "codes": ", ".join(str(c) for c in e["codes"])} for e in gpu.get("xid_errors") or []]}
    if not gpu.get("available"):
        return view | {"missing": gpu.get("missing") or "GPU metrics missing"}
    query = gpu.get("query") or {}
    source = gpu["source"] + (f" {query['url']}, {query['selector']}, {query['start']} to "
                              f"{query['end']}" if "url" in query else "")
    t0 = min((p[0] for per_gpu in gpu["series"].values() for points in per_gpu.values()
              for p in points[:1]), default=0)
    charts = []
    for key, title, unit in _GPU_PLOTS:
        per_gpu = dict(list((gpu["series"].get(key) or {}).items())[:_MAX_PLOTTED_GPUS])
        charts.append(svg_line_chart(
            {name: [(t - t0, v) for t, v in points] for name, points in per_gpu.items()},
            f"{title} per GPU", "seconds", unit))
    return view | {
        "missing": None, "source": source,
        "columns": [(label, unit) for _, label, unit in _GPU_COLUMNS],
        "nodes": _gpu_rows(gpu["nodes"], ("node", "gpus")),
        "gpus": _gpu_rows(gpu["gpus"], ("node", "gpu", "model")),
        "charts": charts, "count": len(gpu["gpus"]),
        "plotted": min(len(gpu["gpus"]), _MAX_PLOTTED_GPUS),
    }


def _host_view(host: dict | None) -> dict | None:
    if not host:
        return None
    cpu, mem = host["metrics"]["cpu_percent"], host["metrics"]["memory_used_bytes"]
    series = host["series"]
    t0 = min((s[0][0] for s in series.values() if s), default=0)
    return {
        "summary": f'{host["samples"]} samples; CPU mean {fmt(cpu["mean"], ".1f", "%")}, max '
                   f'{fmt(cpu["max"], ".1f", "%")}; memory used max {fmt_bytes(mem["max"])} of '
                   f'{fmt_bytes(host.get("memory_total_bytes"))}',
        "charts": [
            svg_line_chart({"CPU %": [(t - t0, v) for t, v in series["cpu_percent"]]},
                           "Host CPU", "seconds", "%"),
            svg_line_chart({"memory used (GiB)": [(t - t0, v / GIB)
                                                  for t, v in series["memory_used_bytes"]]},
                           "Host memory", "seconds", "GiB"),
        ],
    }


_SOURCE_COLUMNS = ("source", "data set", "rows of", "asked", "read", "kept", "skipped",
                   "training examples", "held out", "eval loss")


def _data_view(data: dict | None, eval_by_source: dict | None = None) -> dict | None:
    """The Data section's rows: the prepared set, its counts, lengths and longest skipped rows;
    a mixture's sources as a table of their own (what each asked and gave, its eval loss)."""
    if not data:
        return None
    how = "reused (cache hit)" if data.get("cache_hit") else "prepared by this run"
    took = fmt(data.get("seconds"), ".1f", " s")
    rows = [("prepared set", f"{data.get('path')}: {how} in {took}"),
            *[(key, str(data[key])) for key in ("row_format",) if data.get(key)],
            *[(key, str(data.get(key))) for key in (
                "rows_read", "rows_kept", "skipped_rows", "skipped_rows_by_reason", "train_rows",
                "eval_rows", "tokens_per_epoch")]]
    evaluated = data.get("eval_dataset")
    if evaluated:  # the separate eval data set evaluate measures on, prepared with the set
        rows.append(("eval_dataset", f"{evaluated['dataset']}: {evaluated['rows_kept']} of "
                     f"{evaluated['rows_read']} rows kept, skipped "
                     f"{evaluated['skipped_rows_by_reason'] or 'none'}"))
    histogram = data.get("length_histogram") or {}
    rows += [(f"examples of {bin_} tokens", str(n)) for bin_, n in histogram.items()]
    rows += [(f"skipped: {r['where']}", f"{r['tokens']} tokens, {r['reason']}")
             for r in data.get("longest_skipped_rows") or []]
    losses = eval_by_source or {}
    sources = [[
        s["name"], s["dataset"], s.get("row_format") or "",
        f"weight {s['weight']:g}" if s.get("weight") is not None else f"{s['rows']:,} rows",
        fmt(s["rows_read"], ",.0f"), fmt(s["rows_kept"], ",.0f"),
        f"{fmt(s['skipped_rows'], ',.0f')} {s['skipped_rows_by_reason'] or ''}".strip(),
        f"{fmt(s['train_examples'], ',.0f')} ({s['share']:.1%}"
        + (f", {s['train_rows_available']:,} rows repeated" if s.get("repeated") else "") + ")",
        fmt(s["eval_examples"], ",.0f"),
        "{} → {}".format(*(fmt((losses.get(s["name"]) or {}).get(k), ".4f")
                           for k in ("initial", "final")))]
        for s in data.get("sources") or []]
    return {"rows": rows, "sources": sources, "source_columns": _SOURCE_COLUMNS}


def _preflight_view(preflight: dict | None) -> dict | None:
    """The preflight's table: one row per node, its GPUs, bandwidth and problems."""
    if not preflight:
        return None
    nodes = [[n["node_name"], n["ranks"], ", ".join(n["gpus"]),
              ", ".join(f"{t:.3g}" for t in n["matmul_tflops"]),
              fmt(n["intra_busbw_gbps"], ".1f"), fmt(n["expected_intra_gbps"], ".0f"),
              "ok" if n["ok"] else "; ".join(n["problems"])] for n in preflight["nodes"]]
    across = (f"{fmt(preflight['inter_busbw_gbps'], '.1f')} GB/s bus bandwidth (expected "
              f"{fmt(preflight['expected_inter_gbps'], '.0f')}); {preflight['message_mib']:g} "
              f"MiB messages, {preflight['backend']}")
    return {"nodes": nodes, "across": across, "problems": preflight["problems"]}


def _rank_times_view(ranks: dict | None) -> dict | None:
    if not ranks:
        return None
    flagged = {s["rank"] for s in ranks["stragglers"]}
    rows = [(f"rank {rank}" + (" (straggler)" if rank in flagged else ""), fmt(t, ".3g", " s"))
            for rank, t in enumerate(ranks["median_step_time_s"])]
    return {"threshold": f"{ranks['threshold']:.0%}", "rows": rows}
