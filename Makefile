# The two commands of the README: `make demo` and `make test`. Both set everything up first.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
SOURCES := compiler passes runtime tests examples benchmarks

.PHONY: setup demo lint typecheck test test-suite test-fast jitter-check gpu-check compat vision clean

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
	for f in compiler/*; do ln -s ../../../$$f build/typecheck/pipecut/; done
	ln -s ../../../passes build/typecheck/pipecut/passes
	ln -s ../../../runtime build/typecheck/pipecut/runtime
	cd build/typecheck && ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml -p pipecut

# The whole suite, then `compat` (the two ends of the declared version range), whichever fails:
# either failing fails the target. (Sub-makes, so that `make -n test` only prints.)
test: lint
	$(MAKE) --no-print-directory test-suite; suite=$$?; \
	$(MAKE) --no-print-directory compat; compat=$$?; \
	exit $$(( suite || compat ))

# The multi-process tests (marked dist) run one at a time, their ranks filling the cores; the
# single-process tests run beside them in a second pytest, whose report follows theirs.
test-suite: setup
	if [ -x scripts/install-chromium.sh ]; then scripts/install-chromium.sh; fi
	mkdir -p build
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -m "not dist" -p no:cacheprovider --durations=10 \
		> build/test-single-process.log 2>&1 & single=$$!; \
	trap 'kill $$single 2>/dev/null' INT TERM; \
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -m dist --durations=20; ranks=$$?; \
	wait $$single; one=$$?; \
	echo "== the single-process tests (run beside the multi-process ones above)"; \
	cat build/test-single-process.log; \
	exit $$(( ranks || one ))

test-fast: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q tests/unit

# An audit for tests that depend on the clock: the unit suite with every measured time scaled
# by a seeded random factor (tests/conftest.py); a test it fails reads the machine's timings.
JITTER_SEEDS ?= 1 2
jitter-check: setup
	for s in $(JITTER_SEEDS); do OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q tests/unit --jitter-clock=$$s || exit 1; done

# A short check on whatever CUDA devices exist (scripts/gpu_check.py); exits 0 with a message
# where there are none. The default venv holds a CPU build of torch: pass VENV=<a venv with a
# CUDA build> on a GPU machine.
gpu-check: setup
	OMP_NUM_THREADS=1 $(PY) scripts/gpu_check.py

# The two ends of the versions pyproject.toml declares (README, "Versions"), each in a venv of
# its own, rebuilt when pyproject.toml changes; scripts/compat_check.py runs in each. The main
# venv above is the oldest torch too (its suite is the oldest-torch check); the newest torch is
# a CUDA build that runs on the CPU (about 5.5 GB). The pins go in the same pip command as the
# package, so that resolving '.[test]' cannot move them.
OLDEST := torch==2.13.0 transformers==4.45.2
NEWEST := torch==2.14.1 transformers==5.24.0

.venv-oldest/.installed: pyproject.toml
	python3 -m venv .venv-oldest
	.venv-oldest/bin/python -m pip install -q --upgrade pip
	.venv-oldest/bin/python -m pip install -q $(OLDEST) -e '.[test]'
	touch $@

.venv-newest/.installed: pyproject.toml
	python3 -m venv .venv-newest
	.venv-newest/bin/python -m pip install -q --upgrade pip
	.venv-newest/bin/python -m pip install -q $(NEWEST) -e '.[test]'
	touch $@

compat: .venv-oldest/.installed .venv-newest/.installed
	OMP_NUM_THREADS=1 .venv-oldest/bin/python scripts/compat_check.py; oldest=$$?; \
	OMP_NUM_THREADS=1 .venv-newest/bin/python scripts/compat_check.py; newest=$$?; \
	exit $$(( oldest || newest ))

# Optional: torchvision models (benchmarks/partition.py --only tv/, coverage.py --models tv_...).
# torchvision does not import beside the torch 2.13.0 CPU build; it goes into .venv-newest,
# beside torch 2.14.1 (one 5.5 GB venv, not two).
vision: .venv-newest/.vision
.venv-newest/.vision: .venv-newest/.installed
	.venv-newest/bin/python -m pip install -q $(NEWEST) torchvision==0.29.1
	touch $@

clean:
	rm -rf $(VENV) .venv-oldest .venv-newest build *.egg-info plan.json
