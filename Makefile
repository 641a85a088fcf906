# Developer entry points. `make demo` and `make test` set everything up on a
# fresh machine (a virtualenv in .venv with the project and its test extras).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SOURCES := $(shell find client cli routing node bench proto deploy/federations deploy/k8s -name '*.py' -o -name '*.proto' -o -name '*.geojson' 2>/dev/null)
# The package folders: a folder's time changes when a file in it is added,
# removed or renamed, which the strict link tree must follow too.
SOURCE_DIRS := $(shell find client cli routing node bench proto/geofed/v1 deploy/federations deploy/k8s \
	\( -name __pycache__ -o -path bench/results \) -prune -o -type d -print 2>/dev/null)

.PHONY: setup demo test lint proto clean

setup: $(VENV)/.installed

# Strict editable install: the package tree links to the sources, so mypy and
# tools see `geofed.*`; it is refreshed whenever a source file changes.
$(VENV)/.installed: pyproject.toml $(SOURCES) $(SOURCE_DIRS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]' --config-settings editable_mode=strict
	touch $@

demo: setup
	$(BIN)/geofed demo

test: setup
	$(BIN)/pytest

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy -p geofed

proto: setup
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) build *.egg-info out .pytest_cache .mypy_cache .ruff_cache
