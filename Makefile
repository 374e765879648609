# The two commands of the README: `make demo` and `make test`. Both set everything up first.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
SOURCES := compiler passes runtime tests examples benchmarks

.PHONY: setup demo lint typecheck test test-fast clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A CPU build of torch from this machine's disk; pyproject itself only declares a range.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,lint]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc_per_node=2 examples/demo.py

lint: setup
	$(VENV)/bin/ruff check $(SOURCES)
	$(MAKE) --no-print-directory typecheck

# mypy needs the import name `pipecut`: build a symlink tree that maps it to compiler/ etc.
typecheck: setup
	rm -rf build/typecheck && mkdir -p build/typecheck/pipecut
	for f in compiler/*.py; do ln -s ../../../$$f build/typecheck/pipecut/; done
	ln -s ../../../passes build/typecheck/pipecut/passes
	ln -s ../../../runtime build/typecheck/pipecut/runtime
	cd build/typecheck && ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml -p pipecut

test: lint
	if [ -x scripts/install-chromium.sh ]; then scripts/install-chromium.sh; fi
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q

test-fast: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q tests/unit

clean:
	rm -rf $(VENV) build *.egg-info plan.json
