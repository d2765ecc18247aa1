# The two set-up commands of README.md live here: `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test lint demo bench system-deps clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned, so nothing later can pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,redis,torch,docker,ssh]'
	touch $@

system-deps:
	bash scripts/system-deps.sh

test: $(STAMP) system-deps
	# Two workers, a module per worker (module fixtures start once): most of a test's time
	# is waiting on processes, so two cores run two modules side by side.
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy --strict nbos
	$(VENV)/bin/lint-imports

demo: $(STAMP)
	mkdir -p .nbos-run
	$(PY) -m nbos run examples/demo.ipynb -o .nbos-run/demo.ipynb --kill-executor-after 4

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	for b in bench/[!_]*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
