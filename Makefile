# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export TRACKS_HOME ?= $(CURDIR)/.tracks
export DAGSTER_HOME ?= $(TRACKS_HOME)/dagster

.PHONY: install demo test lint dev clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# requirements.lock pins every distribution (torch to the CPU build: an open torch
# requirement would pull gigabytes of CUDA wheels).
$(VENV)/.installed: pyproject.toml requirements.lock | $(BIN)/python
	$(BIN)/pip install --quiet -c requirements.lock -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/tracks demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/pytest

dev: install
	$(BIN)/tracks instance init
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

clean:
	rm -rf $(TRACKS_HOME)
