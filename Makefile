# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export TRACKS_HOME ?= $(CURDIR)/.tracks
export DAGSTER_HOME ?= $(TRACKS_HOME)/dagster

.PHONY: install demo test lint dev clean browser screenshots mlflow-ui gpu-wheels

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# requirements.lock pins every distribution (torch to the CPU build: an open torch
# requirement would pull gigabytes of CUDA wheels).
$(VENV)/.installed: pyproject.toml requirements.lock | $(BIN)/python
	@echo "Installing the $$(grep -c '==' requirements.lock) locked distributions into $(VENV)" \
		"(torch's CPU build, Dagster, MLflow, Great Expectations; 2.3 GB installed):" \
		"a few minutes the first time, nothing after that."
	$(BIN)/pip install --quiet --no-compile -c requirements.lock -e '.[test]'
	@# Every module is compiled here, once, so that a shell with PYTHONDONTWRITEBYTECODE set
	@# (CI's) does not compile them in every process the tests start (0.04 CPU-s a trainer or a
	@# code location load for Tracks' own; hundreds of processes). pip compiles on one core;
	@# compileall on all of them, 23 s sooner on two. It leaves out what pip would skip: files
	@# written for a later Python than 3.11 (torch ships py312_intrinsics.py).
	$(BIN)/python -m compileall -q -j 0 -x '/py3(1[2-9]|[2-9][0-9])[^/]*\.py$$' \
		$(VENV)/lib/python3*/site-packages pipeline assets resources sensors definitions.py bench
	touch $@

install: $(VENV)/.installed

# `make demo NPROC=2` trains as two ranks under torchrun (gloo on CPU); `make demo
# FAMILY=text-lm` trains the language model family instead of the digits.
NPROC ?= 1
FAMILY ?= digits-cnn
demo: install
	$(BIN)/tracks demo --family $(FAMILY) --nproc-per-node $(NPROC)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Four workers on two cores, slow tests first (tests/conftest.py): the slow tests spend much of
# their time waiting on processes they started; two workers left a third of the CPU idle, three
# still some, five only made each test slower (bench/results/2026-11-27-make-test-night.md).
test: lint browser
	$(BIN)/pytest -n 4 --dist worksteal --durations=25

# The browser test drives Debian's chromium (Playwright's own download is not reachable here).
browser:
	@test -x /usr/bin/chromium || (apt-get update -qq && apt-get install -y -qq chromium chromium-driver)

# Runs the browser test and keeps its screenshots in docs/screenshots: the asset graph, the
# launch dialog, a run page while the trainer trains, training_attempt's metadata and loss
# curve, promoted_model's explain page, the evaluation's tables, a failed schema check, and
# MLflow's runs table and model version page.
screenshots: install browser
	TRACKS_SCREENSHOTS=$(CURDIR)/docs/screenshots $(BIN)/pytest -q tests/test_ui_browser.py

# MLflow's own UI over the same store `make demo` writes: compare runs, curves, model versions.
# MLflow 3.17 opens every experiment on its GenAI pages until a browser picks "Model training"
# at the top of the side bar; it remembers the choice, and experiments open on their runs table
# from then on. The links Tracks writes into Dagster's metadata pick it for the page they open.
mlflow-ui: install
	@echo 'MLflow on http://127.0.0.1:5000: pick "Model training" at the top of its side bar once.'
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(TRACKS_HOME)/mlflow.db \
		--default-artifact-root $(TRACKS_HOME)/mlartifacts -h 127.0.0.1 -p 5000

# DAGSTER_HOME is $(TRACKS_HOME)/dagster, where `tracks instance init` writes dagster.yaml (and
# where `make demo` keeps its runs, so they show in the UI). Dagster 1.13 marks `dagster dev`
# superseded by `dg dev` (the dagster-dg-cli package, which Tracks does not need) and warns on
# every start; that one warning is filtered by its words, nothing else.
dev: install
	$(BIN)/tracks instance init
	PYTHONWARNINGS='ignore:Function `dev_command` is superseded:FutureWarning' \
		$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

# Wheels for bench/gpu_checks.sh on a GPU machine whose image has torch but not Tracks' other
# needs (bench/gpu_wheels.txt), for its Python (GPU_PYTHON_VERSION) and x86-64 Linux.
GPU_PYTHON_VERSION ?= 3.12
gpu-wheels:
	mkdir -p .whl
	grep -v '^#' bench/gpu_wheels.txt | while read -r name; do \
		pin=$$(grep -i "^$$name==" requirements.lock) || { echo "$$name: not in requirements.lock"; exit 1; }; \
		$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --dest .whl \
			--python-version $(GPU_PYTHON_VERSION) --implementation cp \
			--platform manylinux_2_28_x86_64 \
			--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$$pin" || exit 1; \
	done

clean:
	rm -rf $(TRACKS_HOME)
