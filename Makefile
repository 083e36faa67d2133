# One command each: `make demo`, `make test`, `make ui`. Each creates .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch; for a GPU machine see the README (TORCH_SPEC / TORCH_INDEX).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
export DAGSTER_HOME ?= $(CURDIR)/.habitus/dagster

.PHONY: demo test ui clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: a range left open would pull a multi-GB CUDA build on a CPU machine
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e .
	mkdir -p $(DAGSTER_HOME)
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/habitus demo

test: $(VENV)/.installed-dev
	$(PY) -m pytest $(PYTEST_ARGS)

ui: $(VENV)/.installed
	$(VENV)/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

clean:
	rm -rf .habitus
