# `make demo` and `make test` both build .venv from scratch when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST := $(BIN)/python -m pytest

.PHONY: demo test test-slow bench lint constraints clean

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/commbench demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(PYTEST) -m "not slow and not benchmark_suite" -q

test-slow: $(STAMP)
	$(PYTEST) -m "slow" -q

bench: $(STAMP)
	$(PYTEST) -m benchmark_suite tests/bench_suite --benchmark-autosave --benchmark-columns=min,median,mean,max,rounds -q

lint: $(STAMP)
	$(BIN)/ruff check .

constraints: $(STAMP)
	{ sed -n 1p constraints.txt; $(BIN)/python -m pip freeze --all --exclude-editable | grep -v '^pip=='; } > constraints.new
	mv constraints.new constraints.txt

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
