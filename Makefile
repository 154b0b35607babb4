# The two commands: `make demo` (the fine-tuning DAG end to end on this machine) and `make test`
# (the whole suite; `make test-fast` leaves out the tests marked slow).
# Both set up everything they need: a project-local virtualenv, AIRFLOW_HOME and its database,
# and etcd when it can be installed.

PYTHON ?= python3
VENV := $(CURDIR)/.venv
BIN := $(VENV)/bin
CONF ?= {}

export AIRFLOW_HOME := $(CURDIR)/.airflow
export AIRFLOW__CORE__DAGS_FOLDER := $(CURDIR)/dags
export AIRFLOW__CORE__PLUGINS_FOLDER := $(CURDIR)/plugins
export AIRFLOW__CORE__LOAD_EXAMPLES := False
export PYTHONPATH := $(CURDIR)/plugins:$(CURDIR)
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Python caches the bytecode of what it imports: where the environment sets
# PYTHONDONTWRITEBYTECODE, every process (each torchrun worker, each Airflow task) compiled torch,
# transformers and Airflow from source again (`import torch`: 19 s instead of 6.6 s, 2 cores).
unexport PYTHONDONTWRITEBYTECODE
# `airflow standalone` starts its components as `airflow ...` from PATH.
export PATH := $(BIN):$(PATH)

.PHONY: demo test test-fast lint airflow run venv system-deps airflow-db clean mlflow plan docs \
  screenshots

venv: $(VENV)/.installed

# --no-compile: Python compiles what is imported when it is first imported; compiling every
# installed module up front took 137 s of the install instead of 87 (2 cores).
$(VENV)/.installed: requirements.txt requirements-dev.txt trainer/requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-compile --requirement requirements-dev.txt
	touch $@

# System programs from Debian: etcd (torchrun's rendezvous; without it the local target uses
# torch's c10d store), and for the tests Prometheus (metrics queries), Chromium (UI pages) and
# the trainer image's build and run (buildah, debootstrap, docker-registry; image_builder
# buildah needs buildah where Airflow runs), and zip (MWAA's plugins.zip, as docs/deploy.md
# makes it).
SYSTEM_PACKAGES := etcd-server:etcd prometheus:prometheus chromium:chromium buildah:buildah \
  debootstrap:debootstrap docker-registry:docker-registry zip:zip

system-deps:
	@missing=""; for entry in $(SYSTEM_PACKAGES); do \
	  pkg=$${entry%%:*}; bin=$${entry##*:}; \
	  command -v $$bin >/dev/null || [ -x /usr/bin/$$bin ] || [ -x /usr/sbin/$$bin ] \
	    || missing="$$missing $$pkg"; done; \
	[ -z "$$missing" ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends $$missing) >/dev/null \
	      || echo "could not install$$missing: runs use the c10d rendezvous, tests needing them skip"; \
	  else echo "not installed:$$missing (apt-get install$$missing)"; fi; }

# The pool llm_finetune_scheduled trains in: one training at a time on the cluster.
airflow-db: venv
	$(BIN)/airflow db migrate >/dev/null
	$(BIN)/airflow pools set finetune_cluster 1 "GPU cluster: concurrent trainings" \
	  --include-deferred >/dev/null

demo: venv system-deps airflow-db
	$(BIN)/python -m finetune.demo --conf '$(CONF)'

# The fast tests in two processes (pytest-xdist); then the slow ones, most in two processes too,
# a test file to a process at a time (their module fixtures run once), the longest files first
# (SLOW_FIRST: by their durations one at a time, 2026-12-04), so that neither process is left
# with a long one at the end; then BESIDE_RESTART: the Airflow restart test in one process,
# whose training must outlast two outages and which beside the training-heavy tests took 872 s
# instead of 340 (2026-12-04), its trainings one thread each (OMP_NUM_THREADS=1 in its Airflow;
# in a fresh clone beside the image build: 415 s, against 614 s with two threads), and in the
# other the trainer image's build and the eks target's emulator tests (little CPU: a Kubernetes
# API emulator and moto answering). All three run even when one fails.
BESIDE_RESTART := tests/dags/test_airflow_restart.py tests/eks/test_image_buildah.py \
  $(filter-out %/test_image_buildah.py,$(sort $(wildcard tests/eks/test_*.py)))
SLOW_FIRST := $(addprefix tests/,dags/test_promotion_runs.py dags/test_local_faults.py \
  dags/test_airflow_api.py trainer/test_hang.py dags/test_llm_finetune.py \
  trainer/test_training.py bench/test_train.py trainer/test_dpo.py \
  trainer/test_tensor_parallel.py trainer/test_families.py trainer/test_qlora.py)
SLOW_FILES := $(SLOW_FIRST) $(filter-out $(SLOW_FIRST) $(BESIDE_RESTART), \
  $(sort $(wildcard tests/test_*.py tests/*/test_*.py)))

test: venv system-deps airflow-db
	$(BIN)/python -m pytest tests -m "not slow" -n 2; fast=$$?; \
	  $(BIN)/python -m pytest $(SLOW_FILES) -m slow -n 2 --dist loadfile \
	    --no-loadscope-reorder --durations=25; slow=$$?; \
	  $(BIN)/python -m pytest $(BESIDE_RESTART) -m slow -n 2 --dist loadfile \
	    --no-loadscope-reorder --durations=10; restart=$$?; \
	  [ $$fast -eq 0 ] && [ $$slow -eq 0 ] && [ $$restart -eq 0 ]

# The edit-test loop: everything but the tests marked slow (whole Airflow and torchrun runs,
# Chromium, a real api-server); under 2 minutes on 2 cores.
test-fast: venv system-deps airflow-db
	$(BIN)/python -m pytest tests -m "not slow" -n 2

lint: venv
	$(BIN)/ruff check .

# The Airflow UI with this project's DAGs on http://localhost:8080 (credentials are printed).
airflow: venv system-deps airflow-db
	$(BIN)/airflow standalone

# Trigger llm_finetune through the REST API of a running Airflow (`make airflow`) and follow it:
# make run PRESET=tiny-local ARGS='--set max_steps=60'. Exit code: the run's outcome.
PRESET ?=
ARGS ?=
run: venv
	$(BIN)/python -m finetune.cli run --unpause $(if $(PRESET),--preset $(PRESET)) $(ARGS)

# A run's estimated memory per GPU, step time, wall time and cost, before anything is paid for:
# make plan CONF=conf.json (a file or inline JSON) ARGS='--search --scaling --set micro_batch=8'.
# Exit code 1: it does not fit the instance type's GPU (the fastest settings that fit follow).
plan: venv
	$(BIN)/python -m finetune.plan_cli --conf '$(CONF)' $(ARGS)

# docs/parameters.md from the parameter spec the trigger form is built from (finetune.config);
# tests/test_docs.py fails when the committed page is not what this writes.
docs: venv
	$(BIN)/python -m finetune.docs

# docs/*.png from the real UI (tools/screenshots.py): Airflow's api-server, scheduler and
# dag-processor on this checkout, the trigger form in headless Chromium, and a local run of the
# tiny-local preset for the runs page and the report: 95 to 125 s on 2 quiet cores (2026-12-06;
# its run alone took 4 minutes while other work shared them). It also writes
# docs/screenshots.json, what they show that the code decides: tests/test_docs.py fails when
# that is no longer what the code shows (a preset or a stage added without new pictures).
screenshots: venv system-deps
	$(BIN)/python -m tools.screenshots

# The MLflow UI on the local target's embedded store (runs, metrics, the registry's champion) on
# http://127.0.0.1:5000; without MLflow's job runner (seven more processes, for GenAI jobs).
mlflow: venv
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow server \
	  --backend-store-uri sqlite:///$(CURDIR)/mlflow.db \
	  --artifacts-destination $(CURDIR)/mlartifacts --host 127.0.0.1 --port 5000

clean:
	rm -rf $(VENV) $(AIRFLOW_HOME) runs
