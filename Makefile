# torch-ckpt: two commands on a fresh machine.
#   make demo        set up, then train a small GPT on real text with async checkpoints, crash it, resume exactly
#   make test        set up, then run the whole test suite (what CI runs)
#   make test-fast   the edit loop: every test not marked slow (pytest -m "not slow"; a few minutes on an idle machine)
#                    (both run the tests in TEST_WORKERS=2 processes with pytest-xdist)
#   make docs        build the documentation site into site/ (MkDocs, strict: a warning fails; offline)
#   make lint        ruff check . and mypy (configuration in pyproject.toml; `make test` runs them too)
#   make test-suites Lightning's and Accelerate's own test files, plain and with our plugins injected, compared
#                    (not part of `make test`; CPU; SUITES_DIR=../shared/peer-suites; docs/test-suites.md)
#   make venv-path   print the environment's path: . "$$(make -s venv-path)/bin/activate"
#
# The virtual environment lives outside the clone, keyed on a hash of the dependency files, so CI and
# repeated runs reuse it. Override VENV to put it elsewhere.
#
# torch: by default `torch==2.13.0` is installed first. On a CPU-only machine with the CPU wheel on disk
# (pip's find-links) that is the CPU build; elsewhere point pip at the CPU index so no multi-GB CUDA
# build is pulled:   make test TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# GPU machines:      make test TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
# the torch choice is part of the key: another TORCH_SPEC / TORCH_INDEX_URL gets its own environment
DEPS_HASH := $(shell (cat pyproject.toml Makefile; echo "$(TORCH_SPEC) $(TORCH_INDEX_URL)") | sha256sum | cut -c1-16)
CACHE_DIR ?= $(HOME)/.cache/torch-ckpt
VENV ?= $(CACHE_DIR)/venv-$(DEPS_HASH)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deps-installed
PYTEST_ARGS ?=
# `make test` runs the tests in this many processes (pytest-xdist: 18 min instead of 35 on 2 cores; 0: one process)
TEST_WORKERS ?= 2
DEMO_DIR ?= demo_run
# The environment is shared by every clone with these dependency files, and its editable install points
# at the clone that ran `make` last: every target runs this clone's code (subprocesses included) first.
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: demo test test-fast lint setup clean venv-path

setup: $(STAMP)
	@$(PY) -m pip install --quiet --no-deps --no-build-isolation -e . >/dev/null 2>&1 || \
		$(PY) -m pip install --no-deps --no-build-isolation -e .

# No file prerequisites: the path already holds the hash of pyproject.toml, this Makefile and the torch
# choice, so another content is another environment. (A fresh clone's files are newer than any stamp,
# and an mtime rule re-ran the whole install into the shared environment on every clone, CI included.)
$(STAMP):
	@echo ">> creating $(VENV)"
	@mkdir -p $(CACHE_DIR)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

demo: setup
	$(PY) examples/demo.py --work-dir $(DEMO_DIR)

test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)
	$(PY) -m ruff check .
	$(PY) -m mypy

test-fast: setup
	$(PY) -m pytest -n $(TEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy

clean:
	rm -rf $(DEMO_DIR) $(DEMO_DIR)_cluster .pytest_cache build *.egg-info site

venv-path:
	@echo $(VENV)

# The site (mkdocs.yml, pages in docs/, API from the docstrings) into site/; open site/index.html. The docs extra
# is part of dev, so an environment made by `make setup` has it; another one gets it installed here once.
.PHONY: docs
docs: setup
	@$(PY) -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null || \
		$(PY) -m pip install --quiet --no-build-isolation -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# Two simulated nodes of 2 ranks with node-local roots and a local S3 server (moto): node 1's disk is
# deleted mid-run, node 0 resumes from its disk and node 1 fetches only its shards from S3.
.PHONY: demo-cluster
demo-cluster: setup
	$(PY) examples/demo_cluster.py --work-dir $(DEMO_DIR)_cluster

# The same two nodes with a memory tier (tmpfs, each node's newest step replicated to the other): every rank is
# killed between disk saves and node 1's disk and RAM are wiped; both resume from memory, node 1 from node 0's copy.
.PHONY: demo-cluster-memory
demo-cluster-memory: setup
	$(PY) examples/demo_cluster.py --work-dir $(DEMO_DIR)_cluster_memory --memory

# The frameworks' own test files (unmodified copies under SUITES_DIR, or checkouts at the pinned tags), run plain
# and with AsyncDCPCheckpointIO / attach() injected; table in $(SUITES_OUT)/report.md. SUITES_ARGS passes options
# to peer_suites/run.py (e.g. SUITES_ARGS="--only test_model_checkpoint --suites lightning").
SUITES_DIR ?= ../shared/peer-suites
SUITES_OUT ?= suites_report
SUITES_ARGS ?=
# the suites' extra test packages (peer_suites/requirements.txt), beside the environment and on the suites'
# PYTHONPATH only, so `make test` never sees them (tensorboard changes Lightning's default logger)
SUITES_DEPS ?= $(VENV)-suites-$(shell sha256sum peer_suites/requirements.txt | cut -c1-8)
.PHONY: test-suites
test-suites: setup
	@test -f $(SUITES_DEPS)/.installed || { $(PY) -m pip install --quiet --no-deps --target $(SUITES_DEPS) \
		-r peer_suites/requirements.txt && touch $(SUITES_DEPS)/.installed; }
	PYTHONPATH=$(CURDIR) $(PY) -m peer_suites.run --suites-dir $(SUITES_DIR) --out $(SUITES_OUT) \
		--deps $(SUITES_DEPS) $(SUITES_ARGS)
