"""The validate stage: a DAG run's params -> one typed, immutable `RunConfig`, or `ConfigError`
naming every bad field at once.

Accepted means it runs: besides each field's type and bounds, this runs the contract's rules
(finetune_contract: the ones the trainer runs at start), reads the data set and the tokenizer as
the trainer will (fields, formats, chat template, rows too long for seq_len, enough rows for a
step), and the target's own checks. Nothing here calls a cloud API; a hub id's config.json is
read from the hub, without a token, when it answers (finetune.hub).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import ipaddress
import json
import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from finetune.config import ConfigError, RunConfig, run_output_dir
from finetune.hub import GATED, NO_CONFIG, NOT_FOUND, hub_config
from finetune.names import DNS_SUBDOMAIN, LABEL_VALUE, dns_label, run_dir_name
from finetune.run_plan import capacity_problems, model_config_of, plan_run, run_hardware
from finetune.targets import get_target
from finetune.trainer_config import local_dir, run_tokenizer_dir, trainer_config
from finetune_contract import data as contract_data
from finetune_contract.fields import LOWER_IS_BETTER, ContractError, hub_id_problem, quoted
from finetune_contract.mixture import SOURCE_FIELDS, Source, mixture_sources, source_config
from finetune_contract.models import BUILTIN_MODELS, HUB_MODEL_CONFIGS, ModelShape
from finetune_contract.parallel_dims import is_elastic
from finetune_contract.parameters import (
    BY_NAME,
    FORM_PARAMETERS,
    SECRET_NAMES,
    Parameter,
    defaults,
    eval_task_names,
)
from finetune_contract.planner import memory_problems
from finetune_contract.presets import NO_PRESET, PRESET_NAMES, PRESETS, Preset, apply_preset
from finetune_contract.rules import config_problems, location_problems
from finetune_contract.train_config import TrainConfig

log = logging.getLogger(__name__)

Problems = list[tuple[str, str]]
# Rows validate reads (to check columns and count rows); past this prepare_data counts them.
MAX_ROWS_CHECKED = 200_000
# Rows validate encodes: a sample that finds a template or tokenizer that cannot encode this data.
# A data set no larger is checked whole here; a larger one is encoded by prepare_data, whose
# statistics decide (skipped rows, rows for a step) before scale-up.
ROWS_ENCODED = 512
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")


def validate_params(params: Mapping[str, Any], *, run_id: str, dag_id: str = "llm_finetune",
                    given: Mapping[str, Any] | None = None, plan_only: bool = False
                    ) -> RunConfig:
    """Params (from the trigger form, REST conf or defaults) -> RunConfig, or ConfigError.

    A `preset` in params supplies the values of the fields not set on purpose (`given`: the
    conf the run was triggered with; see finetune_contract.presets.apply_preset). plan_only
    (for `python -m finetune.plan_cli`): the training's fields and rules, not the cluster's (its
    name, node group, image, the local machine's cores) nor the memory rule, whose estimate it
    prints.
    """
    errors: Problems = []
    preset = None
    preset_name = params.get("preset", NO_PRESET)
    if not isinstance(preset_name, str) or preset_name not in PRESET_NAMES:
        errors.append(("preset", f"unknown preset {quoted(preset_name)}; known: "
                       + ", ".join(PRESET_NAMES)))
        params = {k: v for k, v in params.items() if k != "preset"}
    else:
        params, preset = apply_preset(params, defaults(), given)
    form = [p.name for p in FORM_PARAMETERS]
    unknown = sorted(set(params) - set(form), key=str)
    if unknown:
        errors.append((str(unknown[0])[:40], "unknown parameter" + (
            f"s {', '.join(quoted(u, 40) for u in unknown)}" if len(unknown) > 1 else "")
            + "; known: " + ", ".join(form)))
    values: dict[str, Any] = {}
    for parameter in FORM_PARAMETERS:
        value = params.get(parameter.name, parameter.default)
        if parameter.type is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if parameter.type is str and isinstance(value, str):
            value = value.strip()
        if value is None and parameter.optional:
            value = ""  # an optional text field left empty in the form
        problem = parameter.type_problem(value) or parameter.problem(value)
        if problem:
            errors.append((parameter.name, problem))
        else:
            values[parameter.name] = value
    if len(values) < len(FORM_PARAMETERS):  # the rules across fields need every field typed
        raise ConfigError(errors)
    run_name = run_dir_name(run_id)
    cfg = RunConfig(
        run_id=run_id, run_name=run_name, rdzv_id=dns_label(dag_id, run_id, max_len=48),
        run_dir=run_output_dir(values["output_dir"], run_name, values["target"]),
        preset_version=preset.version if preset else 0, **values)
    target = get_target(cfg.target)
    problems, size = _run_checks(cfg, paths_are_local=target.paths_are_local,
                                 memory=not plan_only)
    errors += problems
    if size is not None:  # for the plan's steps when max_steps is 0 (finetune.run_plan)
        cfg = dataclasses.replace(cfg, counted_train_rows=size.train_rows,
                                  counted_batches_per_epoch=size.batches_per_epoch)
    if not plan_only:
        errors += launcher_problems(cfg, target.launchers)
        errors += target.check(values)
        if not errors:  # the planner needs a run the rules accept
            errors += target.plan_problems(cfg, plan_run(cfg))
    if errors:
        raise ConfigError(errors)
    return cfg


def run_problems(cfg: RunConfig, paths_are_local: bool = True, memory: bool = True) -> Problems:
    """Every problem of a well-typed run config: fields, the contract's rules, data, tokenizer.

    paths_are_local: the target's (finetune.targets.base.Target): whether the trainer reads
    paths on this machine, or absolute ones in its pods. memory: refuse a run whose estimated
    peak exceeds its GPU's memory (finetune_contract.planner)."""
    return _run_checks(cfg, paths_are_local, memory)[0]


def _run_checks(cfg: RunConfig, paths_are_local: bool, memory: bool
                ) -> tuple[Problems, DataSize | None]:
    """run_problems, and the training split's size where the data was counted."""
    errors = _field_problems(cfg)
    in_pod = not paths_are_local
    try:
        train = TrainConfig(**trainer_config(cfg, local_paths=not in_pod))
    except ContractError as exc:
        return errors + exc.errors, None
    errors += _model_problems(cfg, in_pod)
    config = model_config_of(cfg.model, in_pod)
    shape = ModelShape.from_config(cfg.model, config) if config is not None else None
    named = {field for field, _ in errors}
    # The run dir is output_dir/<run>: a bad output_dir is named once, as the user gave it.
    errors += [(field, message) for field, message in config_problems(
        train, world_size=cfg.world_size, local_world_size=cfg.procs_per_node, shape=shape)
        if not (field == "output_dir" and field in named)]
    errors += evaluation_problems(cfg, train, in_pod)
    if memory and not errors:  # the planner needs a run the rules accept
        errors += memory_problems(train, world_size=cfg.world_size,
                                  local_world_size=cfg.procs_per_node,
                                  hardware=run_hardware(cfg), config=config)
        errors += capacity_problems(cfg, train, config)
    size = None
    if not errors:
        problems, size = _checked_data(cfg, train, in_pod)
        errors += problems
    return _dedupe(errors), size


def evaluation_problems(cfg: RunConfig, train: TrainConfig, in_pod: bool) -> Problems:
    """The evaluate and promote stages' fields: a promotion metric the evaluation measures, an
    eval data set that exists with the fields the training reads."""
    errors: Problems = []
    if cfg.promotion_metric not in LOWER_IS_BETTER:
        task, _, metric = cfg.promotion_metric.partition(".")
        if not metric or task not in eval_task_names(cfg.eval_tasks):
            errors.append(("promotion_metric", (
                f"{quoted(cfg.promotion_metric)} is not measured by this run: give "
                + ", ".join(LOWER_IS_BETTER) + ", or <task>.<metric> of a task in eval_tasks "
                f"({cfg.eval_tasks or 'none'}), e.g. demo_instructions.acc")))
    if not train.eval_dataset or contract_data.dataset_source(train.eval_dataset) != "local" \
            or (in_pod and cfg.eval_dataset.startswith("/")):
        return errors  # read where the trainer runs
    try:
        files = contract_data.data_files(Path(train.eval_dataset), cfg.dataset_format)
        rows = contract_data.read_rows(files, cfg.dataset_format, MAX_ROWS_CHECKED)
    except ValueError as exc:
        return errors + [("eval_dataset", str(exc))]
    except OSError as exc:
        return errors + [("eval_dataset", f"cannot read {quoted(cfg.eval_dataset)}: "
                          f"{exc.strerror}")]
    if rows is not None and not rows.rows:
        return errors + [("eval_dataset", f"{quoted(cfg.eval_dataset)} has no usable rows")]
    if rows is not None:
        evaluated = contract_data.row_format(dataclasses.replace(train, mixture=None),
                                             rows.columns)
        errors += [("eval_dataset", message) for _, message in
                   contract_data.missing_columns(evaluated, rows.columns, cfg.eval_dataset)]
    return errors


def _dedupe(errors: Problems) -> Problems:
    return list(dict.fromkeys(errors))


def _model_problems(cfg: RunConfig, in_pod: bool) -> Problems:
    if cfg.model in BUILTIN_MODELS or (in_pod and cfg.model.startswith("/")):
        return []
    model_dir = local_dir(cfg.model, in_pod)
    if model_dir is not None and model_dir.is_dir():
        if not (model_dir / "config.json").is_file():
            return [("model", f"directory {quoted(cfg.model)} has no config.json")]
        try:
            config = json.loads((model_dir / "config.json").read_text())
        except (OSError, ValueError) as exc:
            return [("model", f"{quoted(cfg.model)}: config.json cannot be read as JSON ({exc})")]
        if not isinstance(config, dict):
            return [("model", f"{quoted(cfg.model)}: config.json holds no JSON object")]
        return []
    hub_problem = hub_id_problem(cfg.model, namespaced=True)
    if hub_problem is None:
        return _hub_model_problems(cfg)
    return [("model", f"{quoted(cfg.model)} is not a built-in config ("
             + ", ".join(BUILTIN_MODELS) + "), an existing model directory or a hub id "
             f"(org/name): as a hub id it {hub_problem}")]


def _hub_model_problems(cfg: RunConfig) -> Problems:
    """What the hub says of a hub id whose shape is not stored here (finetune.hub): refused
    when the trainer would fail on it too; else validate goes on and the trainer checks."""
    if cfg.model in HUB_MODEL_CONFIGS:
        return []
    found = hub_config(cfg.model)
    if found.config is not None:
        return []
    no_token = cfg.target == "eks" and not cfg.hf_token_secret
    if found.kind == NO_CONFIG or (found.kind in (NOT_FOUND, GATED) and no_token):
        advice = "" if found.kind == NO_CONFIG else \
            ": give hf_token_secret, a Secret holding a token that can read it"
        return [("model", f"hub id {quoted(cfg.model)}: {found.reason}{advice}")]
    log.info("model %s: config.json not read at validate (%s); the trainer checks its "
             "architecture at start", cfg.model, found.reason)
    return []


def _field_problems(cfg: RunConfig) -> Problems:
    """Fields with a form of their own: endpoints, secrets' names, labels, ports."""
    errors: Problems = []
    if cfg.mixture and cfg.dataset != BY_NAME["dataset"].default:
        errors.append(("dataset", f"{quoted(cfg.dataset)} is set beside a mixture, whose "
                       "sources are the run's data: make it one of the mixture's sources, or "
                       "leave dataset at its default"))
    if is_elastic(cfg) and not cfg.max_restarts:
        errors.append(("max_restarts", f"0 with min_nodes {cfg.min_nodes} below nodes "
                       f"{cfg.nodes}: a lost node is a restart of the others' workers in a "
                       "smaller world; set max_restarts to at least 1"))
    if cfg.capacity_fallback == "on-demand" and not cfg.fallback_nodegroup \
            and cfg.target == "eks":
        errors.append(("fallback_nodegroup", "is empty with capacity_fallback on-demand: name "
                       "the on-demand node group to fall back to"))
    rdzv_port = None
    if cfg.rdzv_endpoint:
        endpoint = host_port(cfg.rdzv_endpoint)
        if endpoint is None:
            errors.append(("rdzv_endpoint", "is not host:port (an IPv6 host in brackets: "
                           "[::1]:2379), and holds no credentials; the value is not shown"))
        else:
            rdzv_port = endpoint[1]
    if cfg.metrics_port and cfg.metrics_port == rdzv_port:
        errors.append(("metrics_port", f"{cfg.metrics_port} is the rendezvous port: rank 0 "
                       "cannot serve metrics there; choose another port"))
    if cfg.prometheus_url:
        errors += _prometheus_problems(cfg.prometheus_url)
    if cfg.hf_token_secret:
        name, _, key = cfg.hf_token_secret.partition(":")
        if not DNS_SUBDOMAIN.match(name) or \
                (":" in cfg.hf_token_secret and not _SECRET_KEY.match(key)):
            errors.append(("hf_token_secret", "give the Secret's name, or name:key (a name: "
                           "lowercase letters, digits, '-' and '.'; a key: letters, digits, "
                           "'-', '_' and '.'); the value is not shown, as it may be a token"))
    if cfg.nodegroup and not LABEL_VALUE.match(cfg.nodegroup):
        errors.append(("nodegroup", f"{quoted(cfg.nodegroup)} is not a Kubernetes label value "
                       "(the nodes' eks.amazonaws.com/nodegroup label): at most 63 letters, "
                       "digits, '-', '_' and '.', starting and ending with a letter or digit"))
    if cfg.output_dir.startswith("s3://"):
        errors += location_problems("output_dir", cfg.output_dir)
    return errors


def launcher_problems(cfg: RunConfig, launchers: tuple[str, ...]) -> Problems:
    """A launcher the target has not (`launchers`: the target's, finetune.targets.base.Target);
    the target checks which combinations its launchers can run."""
    if cfg.launcher in launchers:
        return []
    return [("launcher", f"{cfg.launcher} is not a launcher of target {cfg.target} (it has "
             + ", ".join(launchers) + ")")]


def host_port(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of `host:port` or `[ipv6]:port`; None when malformed or with userinfo."""
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})|([^\s:@/\[\]]+):(\d{1,5})", endpoint)
    if not match:
        return None
    host, port = (match[1], match[2]) if match[1] else (match[3], match[4])
    try:
        if match[1]:
            ipaddress.IPv6Address(host)
        elif not _HOST.match(host):
            return None
    except ValueError:
        return None
    return (host, int(port)) if 0 < int(port) <= 65535 else None


def _prometheus_problems(url: str) -> Problems:
    match = re.fullmatch(r"(https?)://([^/\s]+)(/\S*)?", url)
    if not match:
        return [("prometheus_url", "is not an http(s)://host[:port][/path] URL (the value is "
                 "not shown)")]
    if "@" in match[2]:
        return [("prometheus_url", "holds credentials (user:password@): they would be stored "
                 "with the run and shown in its report. Put them in an Airflow HTTP connection "
                 "and name it in prometheus_conn_id")]
    if re.search(r"[?#]", match[2] + (match[3] or "")):
        return [("prometheus_url", "has a query or fragment (?... or #...), which the queries "
                 "would not send and the run would store (a token, say): give the base URL "
                 "alone, and credentials in an Airflow HTTP connection named in "
                 "prometheus_conn_id")]
    netloc = match[2]
    if re.fullmatch(r"\[[^\]]*\]|[^:]*", netloc):
        netloc += ":80"  # no port: the scheme's (any port passes what follows)
    if host_port(netloc) is None:
        return [("prometheus_url", "its host is not a host name or IP address, or its port is "
                 "not 1-65535 (http(s)://host[:port][/path]; the value is not shown)")]
    return []


@dataclasses.dataclass(frozen=True)
class DataSize:
    """The training split as validate counted it (RunConfig.counted_*)."""

    train_rows: int  # packed: about how many sequences they pack into
    batches_per_epoch: int  # per data-parallel rank


def _checked_data(cfg: RunConfig, train: TrainConfig, in_pod: bool
                  ) -> tuple[Problems, DataSize | None]:
    """The data set and tokenizer as the trainer will read them, where they are visible here;
    and the training split's size where it was counted (one data set: a mixture's is counted
    by prepare_data, once its sources are drawn)."""
    errors: Problems = []
    tokenizer_dir = run_tokenizer_dir(cfg, in_pod)
    if tokenizer_dir is not None:
        errors += contract_data.tokenizer_problems(
            tokenizer_dir, "tokenizer" if cfg.tokenizer else "model", train)
    elif cfg.tokenizer and not (in_pod and cfg.tokenizer.startswith("/")):
        errors.append(("tokenizer", f"directory {quoted(cfg.tokenizer)} does not exist"))
    if cfg.mixture:
        for source in mixture_sources(cfg.mixture):
            problems, _ = _data_set_problems(
                dataclasses.replace(cfg, mixture="", **source.fields),
                source_config(train, source), in_pod, tokenizer_dir, errors, source)
            errors += problems
        return errors, None
    if not cfg.dataset:
        return errors + [("dataset", "is empty; give a data file, directory, s3:// URI or hub "
                          "name")], None
    problems, size = _data_set_problems(cfg, train, in_pod, tokenizer_dir, errors)
    return errors + problems, size


def _data_set_problems(cfg: RunConfig, train: TrainConfig, in_pod: bool,
                       tokenizer_dir: Path | None, before: Problems,
                       source: Source | None = None) -> tuple[Problems, DataSize | None]:
    """One data set (the run's, or a mixture's `source`, whose problems name it by its index
    and key: mixture[1].response_field) as the trainer will read it: its files, columns,
    kind of rows and, unless `before` holds problems, a sample of its rows encoded."""
    problems, size = _read_data_set(cfg, train, in_pod, tokenizer_dir, before, source)
    if source is None:
        return problems, size
    return [(f"{source.where}.{field}", message) if field in SOURCE_FIELDS else
            (field, f"{source.where} ({source.name}): {message}")
            for field, message in problems], None


def _read_data_set(cfg: RunConfig, train: TrainConfig, in_pod: bool,
                   tokenizer_dir: Path | None, before: Problems, source: Source | None
                   ) -> tuple[Problems, DataSize | None]:
    errors: Problems = []
    source_kind = contract_data.dataset_source(train.dataset)
    if source_kind in ("s3", "hub") or (in_pod and cfg.dataset.startswith("/")):
        return errors, None  # read where the trainer runs (an s3:// one is checked at scale_up)
    path = Path(train.dataset)
    try:
        files = contract_data.data_files(path, cfg.dataset_format)
        for file in files:
            contract_data.file_format(file, cfg.dataset_format)
        rows = contract_data.read_rows(files, cfg.dataset_format, MAX_ROWS_CHECKED)
    except ValueError as exc:
        field = "dataset_format" if "dataset_format" in str(exc) else "dataset"
        return errors + [(field, str(exc))], None
    except OSError as exc:
        return errors + [("dataset", f"cannot read {quoted(cfg.dataset)}: {exc.strerror}")], None
    if rows is None:  # parquet without pyarrow here: the trainer reads it
        return errors, None
    if not rows.rows and not rows.malformed:
        return errors + [("dataset", f"{quoted(cfg.dataset)} has no rows")], None
    if rows.rows:
        train = contract_data.row_format(train, rows.columns)  # conversations found by themselves
        other_method = source is not None and \
            contract_data.other_method_problem(train, rows.columns)
        if other_method:
            return errors + [("dataset", f"{quoted(cfg.dataset)} {other_method}")], None
        errors += contract_data.missing_columns(train, rows.columns, cfg.dataset)
        template = tokenizer_dir and contract_data.chat_template_problem(tokenizer_dir, train)
        if template:
            errors.append(("messages_field", template))
    if rows.malformed and cfg.bad_rows == "error":
        place, what = rows.malformed[0]
        errors.append(("dataset", contract_data.bad_row_error(train, place, what)))
    if before or errors or tokenizer_dir is None:
        return errors, None
    return _row_problems(cfg, train, rows, tokenizer_dir, files, whole_run=source is None)


def _row_problems(cfg: RunConfig, train: TrainConfig, rows: contract_data.FileRows,
                  tokenizer_dir: Path, files: list[str], whole_run: bool = True
                  ) -> tuple[Problems, DataSize | None]:
    """Encode a sample of the rows as prepare_data will (the template and tokenizer work on this
    data; bad_rows=error and a bad row in it); a data set no larger than the sample is checked
    whole: rows too long or empty, enough for a step, the training split's size. A mixture's
    source (not whole_run) is held to its own held-out split only: the step is the mixture's."""
    if importlib.util.find_spec("transformers") is None:
        # an Airflow without transformers (MWAA): prepare_data encodes, where it runs
        log.info("transformers is not installed here: rows are encoded by prepare_data")
        return [], None
    whole = len(rows.rows) <= ROWS_ENCODED
    sample = rows if whole else dataclasses.replace(
        rows, rows=rows.rows[:ROWS_ENCODED], places=rows.places[:ROWS_ENCODED])
    stamps = (cfg.dataset_format, len(sample.rows),
              *((file, *_stamp(Path(file))) for file in files))
    try:
        lengths, bad, first_bad = _encoded(stamps, _stamp(tokenizer_dir), str(tokenizer_dir),
                                           _encoding_fields(train), sample)
    except ValueError as exc:  # a chat template that cannot mask the prompt
        return [("prompt_template", str(exc))], None
    if first_bad is not None and cfg.bad_rows == "error":
        return [("dataset", contract_data.bad_row_error(train, *first_bad))], None
    if not whole_run:
        if whole or len(rows.rows) + len(rows.malformed) < MAX_ROWS_CHECKED:
            try:
                contract_data.split_sizes(len(lengths) if whole else len(rows.rows), train)
            except ValueError as exc:
                return [("dataset", str(exc))], None
        return [], None
    data_parallel = cfg.parallel_dims.dp_degree
    if not whole:
        # Counted unencoded, every row as if usable: too few even so is too few.
        if len(rows.rows) + len(rows.malformed) < MAX_ROWS_CHECKED:
            try:
                n_train, _ = contract_data.split_sizes(len(rows.rows), train)
                contract_data.batches_per_epoch(n_train, cfg.micro_batch, data_parallel)
            except ValueError as exc:
                return [("micro_batch", str(exc))], None
        return [], None
    try:
        n_train, _ = contract_data.split_sizes(len(lengths), train)
        size = DataSize(n_train, contract_data.batches_per_epoch(n_train, cfg.micro_batch,
                                                                  data_parallel))
        if cfg.packing:
            packed = contract_data.min_packed_rows(lengths, cfg.seq_len, n_train)
            try:
                contract_data.batches_per_epoch(packed, cfg.micro_batch, data_parallel)
            except ValueError as exc:
                raise ValueError(f"with packing, {n_train} training rows may pack into as few "
                                 f"as {packed} sequences: {exc}") from None
            about = contract_data.expected_packed_rows(lengths, cfg.seq_len, n_train)
            size = DataSize(about, contract_data.batches_per_epoch(about, cfg.micro_batch,
                                                                    data_parallel))
    except ValueError as exc:
        skipped = f" ({bad} bad rows skipped)" if bad else ""
        # The eval split takes at least micro_batch rows: a micro_batch that large is the cause
        # when micro_batch 1 would have left rows to train on.
        usable = len(lengths)
        fits_one = usable - max(math.ceil(train.eval_fraction * usable), 1) >= data_parallel
        by_micro_batch = "micro_batch (" in str(exc) or fits_one
        return [("micro_batch" if by_micro_batch else "dataset", f"{exc}{skipped}")], None
    return [], size


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def _encoding_fields(train: TrainConfig) -> tuple:
    """What an example's encoding depends on, besides the rows and the tokenizer."""
    return (train.text_field, train.prompt_field, train.response_field, train.messages_field,
            train.prompt_template, train.seq_len, train.method, train.chosen_field,
            train.rejected_field)


class _Rows:
    """FileRows that hash by the files' stamps, so an encoding is cached per data set version."""

    def __init__(self, stamps: tuple, rows: contract_data.FileRows):
        self.stamps, self.rows = stamps, rows

    def __hash__(self) -> int:
        return hash(self.stamps)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Rows) and other.stamps == self.stamps


def _encoded(stamps: tuple, tokenizer_stamp: tuple, tokenizer_dir: str, fields: tuple,
             rows: contract_data.FileRows) -> tuple[list[int], int, tuple[str, str] | None]:
    return _encoded_cached(_Rows(stamps, rows), tokenizer_stamp, tokenizer_dir, fields)


@functools.lru_cache(maxsize=16)
def _encoded_cached(rows: _Rows, tokenizer_stamp: tuple, tokenizer_dir: str, fields: tuple
                    ) -> tuple[list[int], int, tuple[str, str] | None]:
    """(lengths of the usable rows, bad rows, the first bad row's (place, what)): every row
    encoded as prepare_data will. Cached: validate runs often on one data set (tests, retries)."""
    from finetune_contract.transformers_import import AutoTokenizer

    names = ("text_field", "prompt_field", "response_field", "messages_field",
             "prompt_template", "seq_len", "method", "chosen_field", "rejected_field")
    train = TrainConfig(**dict(zip(names, fields, strict=True)))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    lengths: list[int] = []
    bad = len(rows.rows.malformed)
    first_bad = rows.rows.malformed[0] if rows.rows.malformed else None
    for place, row in zip(rows.rows.places, rows.rows.rows):
        if train.method == "dpo":  # a pair: its longer example is what must fit
            problem, chosen, rejected = contract_data.encode_pair(tokenizer, train, row)
            input_ids = max(chosen[0], rejected[0], key=len)
        else:
            problem, input_ids, _ = contract_data.encode_row(tokenizer, train, row)
        if problem is None:
            lengths.append(len(input_ids))
            continue
        bad += 1
        first_bad = first_bad or (place, problem[1])
    return lengths, bad, first_bad


def secret_safe(field: str, value: Any) -> str:
    """How a field's value may appear in a log line."""
    return "(set, not shown)" if field in SECRET_NAMES and value else quoted(value)


def config_table(cfg: RunConfig) -> str:
    """The values the run will use as one table for the validate task's log: field, value and
    where the value comes from (the built-in default, the preset, or this run), by section; a
    value set for another target or method than the run's says that this run does not use it."""
    form_defaults = defaults()
    preset = PRESETS.get(cfg.preset)
    width = max(len(p.name) for p in FORM_PARAMETERS)
    rows = [(p.section, p.name, secret_safe(p.name, getattr(cfg, p.name)),
             _value_source(p.name, getattr(cfg, p.name), form_defaults, preset)
             + _unused(p, cfg, form_defaults))
            for p in FORM_PARAMETERS]
    value_width = min(40, max(len(value) for _, _, value, _ in rows))
    lines = [f"  {'field':<{width}}  {'value':<{value_width}}  from",
             f"  {'-' * width}  {'-' * value_width}  {'-' * 16}"]
    section = None
    for row_section, name, value, source in rows:
        if row_section != section:
            section = row_section
            lines.append(f"  [{section}]")
        lines.append(f"  {name:<{width}}  {value:<{value_width}}  {source}")
    return "\n".join(lines)


def _unused(p: Parameter, cfg: RunConfig, form_defaults: Mapping[str, Any]) -> str:
    """A note for a value set away from its default where the run does not read it."""
    if getattr(cfg, p.name) == form_defaults[p.name]:
        return ""
    if cfg.target not in p.targets:
        return f"; not used by target {cfg.target}"
    if cfg.method not in p.methods:
        return f"; not used by method {cfg.method}"
    return ""


def _value_source(name: str, value: Any, defaults: Mapping[str, Any],
                  preset: Preset | None) -> str:
    if preset is not None and name in preset.values and value == preset.values[name]:
        return f"preset {preset.name}"
    return "default" if value == defaults[name] else "this run"
