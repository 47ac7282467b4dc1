# Two commands on a fresh machine: `make run` and `make test`. Both bootstrap .venv idempotently.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/pip install -q --disable-pip-version-check -c constraints.txt
CONFIG ?= configs/tiny.yaml

.PHONY: run test venv ui-check clean-runs

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) --upgrade pip 2>&1 | grep -v "is ignored" || true
	$(PIP) torch==2.13.0 2>&1 | grep -v "is ignored" || true
	$(PIP) -e ".[dev]" 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import torch, diffusers, prefect, sky, s3fs, onnxruntime, spotlight" 
	touch $(STAMP)

run: venv
	OMP_NUM_THREADS=1 PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/spotlight run --config $(CONFIG)

test: venv
	$(BIN)/ruff check
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25 tests

clean-runs:
	rm -rf runs

ui-check: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -s tests/test_prefect_deploy.py -k ui
