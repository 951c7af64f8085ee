# The two commands a new user runs: `make demo` (the main job) and `make test` (the test suite).
# Each creates .venv from constraints.txt when it is missing (with the test and serve extras: the
# KServe server's tests need Ray Serve): torch is pinned to the CPU build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench validate clean

# The C source too: the install builds it (clika_runtime/state/_unchanged.c), a change rebuilds it.
$(STAMP): pyproject.toml constraints.txt clika_runtime/state/_unchanged.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test,serve]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

# Two worker processes, each taking whole files (module-scoped captures are made once per file):
# the suite takes about 15 min on 2 cores instead of 26 serially. `-n 0` runs it in one process.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

bench: $(STAMP)
	$(PY) scripts/bench.py

validate: $(STAMP)
	$(PY) scripts/validate_graphs.py

clean:
	rm -rf $(VENV) build *.egg-info
