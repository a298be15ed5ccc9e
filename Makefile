# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the whole suite).
# Both build .venv first from the locked requirements (see requirements/README.md).

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTHON312 := $(shell pyenv which python3.12 2>/dev/null || command -v python3.12)

.PHONY: install test demo lock

install: $(STAMP)

$(STAMP): requirements/lock.txt requirements/no-deps.txt pyproject.toml
	@test -n "$(PYTHON312)" || { echo "Python 3.12 not found (pyenv install 3.12, or put python3.12 on PATH)"; exit 1; }
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-deps -r requirements/lock.txt
	$(PY) -m pip install --quiet --no-deps -r requirements/no-deps.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# two pytest workers, one per core of the CI machine; a test file's tests stay in one worker (its module fixtures
# run once), files handed out in collection order (tests/conftest.py puts those with long commands first);
# TEST_WORKERS=0 runs the suite in this one process
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

demo: $(STAMP)
	$(PY) -m lightning_megatron.cli.quickstart

lock: $(STAMP)
	$(PY) -m pip freeze --exclude-editable | grep -vE '^(megatron-bridge|mbridge)==' > requirements/lock.txt
