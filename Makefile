# One command each: `make demo`, `make demo-small`, `make test`, `make ui`, `make docs`. Each creates .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch; for a GPU machine see the README (TORCH_SPEC / TORCH_INDEX).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
export DAGSTER_HOME ?= $(CURDIR)/.habitus/dagster

.PHONY: demo demo-small test ui docs clean test-integration
.PHONY: test-faults test-daemon

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

# the manual: MkDocs with the Material theme (the `docs` extra), built into .habitus/site
$(VENV)/.installed-docs: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

# Connector integration tests: the drivers in .venv, each server's own environment beside it.
# fakesnow (a Snowflake-compatible server) needs snowflake-connector-python < 5 and its own sqlglot.
FAKESNOW_VENV ?= .venv-fakesnow

$(VENV)/.installed-integration: $(VENV)/.installed-dev
	$(PY) -m pip install -q -e ".[dev,integration,mlflow]"
	# the daemon collision test's Postgres instance storage (tests/integration/test_daemon_collisions.py)
	$(PY) -m pip install -q "dagster-postgres==0.29.27"
	touch $@

$(FAKESNOW_VENV)/.installed:
	test -x $(FAKESNOW_VENV)/bin/python || $(PYTHON) -m venv $(FAKESNOW_VENV)
	$(FAKESNOW_VENV)/bin/pip install -q "fakesnow[server]==0.12.1" "duckdb>=2.0,<2.1" "snowflake-connector-python>=4,<5"
	touch $@

# An MLflow tracking server (SQLite store) for tests/integration/test_mlflow_tracking.py: full mlflow pins
# pyarrow<26, so the server has its own environment; .venv holds the client (the mlflow extra).
MLFLOW_VENV ?= .venv-mlflow

$(MLFLOW_VENV)/.installed:
	test -x $(MLFLOW_VENV)/bin/python || $(PYTHON) -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/pip install -q "mlflow>=3,<4"
	touch $@

# Spark's Thrift server: a real HiveServer2 endpoint for the Hive connector (needs Java 17).
SPARK_VENV ?= .venv-spark

$(SPARK_VENV)/.installed:
	test -x $(SPARK_VENV)/bin/python || $(PYTHON) -m venv $(SPARK_VENV)
	$(SPARK_VENV)/bin/pip install -q "pyspark==4.3.0"
	touch $@

# bqemulator (BigQuery REST + Storage Read gRPC on DuckDB) pins its own duckdb and sqlglot.
BQ_VENV ?= .venv-bqemulator

$(BQ_VENV)/.installed:
	test -x $(BQ_VENV)/bin/python || $(PYTHON) -m venv $(BQ_VENV)
	$(BQ_VENV)/bin/pip install -q "bqemulator==1.4.0" "duckdb==1.5.5" "duckdb-extension-spatial==1.5.5" numpy \
		google-cloud-bigquery-storage
	touch $@

# Fault injection: the pipeline SIGKILLed at random points in subprocesses (tests/faults; a few minutes).
test-faults: $(VENV)/.installed-dev
	$(PY) -m pytest -m faults tests/faults $(PYTEST_ARGS)

# every server test, the daemon collisions included (CI)
test-integration: $(VENV)/.installed-integration $(FAKESNOW_VENV)/.installed $(SPARK_VENV)/.installed $(BQ_VENV)/.installed \
		$(MLFLOW_VENV)/.installed
	$(PY) -m pytest -m integration tests/integration $(PYTEST_ARGS)

# only the daemon collisions: a sensor, a backfill and a training run through the real dagster-daemon, on
# SQLite and on Postgres (tests/integration/test_daemon_collisions.py; about 14 minutes on a busy 2-core machine)
test-daemon: $(VENV)/.installed-integration
	$(PY) -m pytest -m daemon tests/integration $(PYTEST_ARGS)

# the instance settings (telemetry off, run queue): dagster.yaml, copied when missing or older
$(DAGSTER_HOME)/dagster.yaml: dagster.yaml
	@mkdir -p $(DAGSTER_HOME)
	@cp dagster.yaml $@

demo: $(VENV)/.installed $(DAGSTER_HOME)/dagster.yaml
	$(VENV)/bin/habitus demo

# the small example (examples/small.yaml): the same warehouse with 400 customers, every asset, the same table
demo-small: $(VENV)/.installed $(DAGSTER_HOME)/dagster.yaml
	$(VENV)/bin/habitus demo --config examples/small.yaml --customers 400

test: $(VENV)/.installed-dev
	$(PY) -m pytest $(PYTEST_ARGS)

ui: $(VENV)/.installed $(DAGSTER_HOME)/dagster.yaml
	DAGSTER_GRPC_TIMEOUT_SECONDS=$${DAGSTER_GRPC_TIMEOUT_SECONDS:-300} $(VENV)/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

# the manual into .habitus/site (open .habitus/site/index.html); --strict: a broken link or anchor, or a
# page left out of the navigation, fails. The config reference is generated first from the schema.
docs: $(VENV)/.installed-docs
	$(PY) -m habitus.pipelines.config.reference --write
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf .habitus

# The unit suite again under a shifted wall clock (Debian's libfaketime): a test or a default that reads
# today's date fails here before it fails for a user. The clock is shifted by an offset ("+Ns"), not
# started at CLOCK: a start time restarts in every new process, an offset keeps one clock for all.
# Not the UI test: libfaketime 0.9.10 shifts the monotonic clock but not sem_clockwait, so a lock or
# event waited on with a timeout waits the whole offset (dagster dev's daemon hangs), and leaving the
# monotonic clock alone makes Python's time.sleep fail with EINVAL.
CLOCK ?= 2028-01-01 06:00:00
.PHONY: test-clock
test-clock: $(VENV)/.installed-dev
	@command -v faketime >/dev/null || { echo "test-clock needs Debian's faketime (apt-get install faketime)" >&2; exit 1; }
	@offset=$$(( $$(date -u -d '$(CLOCK)' +%s) - $$(date -u +%s) )); \
	faketime -f "+$${offset}s" $(PY) -c 'import datetime; print("shifted clock: now", datetime.datetime.now().isoformat(timespec="seconds"))' && \
	faketime -f "+$${offset}s" $(PY) -m pytest -p no:cacheprovider -m "not integration and not ui" $(PYTEST_ARGS)
