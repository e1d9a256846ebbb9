# make train   train the default captioner on the built-in shapes (CPU, no download)
# make test    lint (ruff, the import contract in pyproject.toml) and run the test suite
# make learning-bench  vitattn against a plain timm loop on small real datasets (docs/learning.md)
# make transfer-bench  captions on a classification-pretrained encoder against from scratch (docs/transfer.md)
# make mutation  the mutation harness on the frozen mutant list (docs/mutation/; not part of make test)
# Both create .venv and install the project into it when needed.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.vitattn-installed
ARGS   ?=
# pytest-xdist processes: each test runs one torch thread (tests/conftest.py), so one per core; the files in the
# order tests/conftest.py gives them (the longest first), not xdist's by number of tests
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: install train lint test test-fast bench learning-bench transfer-bench mutation clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/vitattn-train $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

test: lint
	$(PYTEST)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[dev,bench]"
	$(PY) -m benchmarks $(ARGS)

# vitattn-train against a plain timm loop on two Debian-packaged datasets (docs/learning.md)
learning-bench: $(STAMP)
	$(PY) -m benchmarks learning $(ARGS)

# captions on the shapes: encoder from scratch, pretrained by classification, and frozen (docs/transfer.md)
transfer-bench: $(STAMP)
	$(PY) -m benchmarks transfer $(ARGS)

# every mutant of docs/mutation/mutants.json against its module's tests (scripts/mutation.toml), one process, niced;
# the results in docs/mutation/$(MUTATION_RUN).json (ARGS=--resume continues one), then the table against before
MUTATION_RUN ?= after
mutation: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) scripts/mutation.py run --out docs/mutation/$(MUTATION_RUN).json $(ARGS)
	$(PY) scripts/mutation.py table docs/mutation/$(MUTATION_RUN).json docs/mutation/before.json

clean:
	rm -rf runs multirun bench_results .pytest_cache
