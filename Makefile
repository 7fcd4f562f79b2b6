# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.bigmem-installed

.PHONY: demo test test-numa lint install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/bigmem train

lint: $(STAMP)
	$(BIN)/ruff check .

# One pytest process per core, at most TEST_WORKERS (each imports TensorFlow and holds ~1 GiB): much of
# the suite is single-threaded Python and TensorFlow start-up, which one process per core overlaps.
# worksteal: an idle worker takes tests queued on a busy one, so a few long tests do not end the run alone.
TEST_WORKERS ?= 4
test: lint
	$(BIN)/python -m pytest -n auto --maxprocesses $(TEST_WORKERS) --dist worksteal

# The `numa` tests, inside a 4-node kernel under QEMU (tools/numa-vm; without KVM an hour or more on 2 cores:
# every bigmem run imports TensorFlow, 1.5-14 min under emulation depending on the host; benchmarks/results/numa.md).
# They live in tests/numa: collecting the whole suite would import TensorFlow, minutes under emulation.
# The guest gets three hours before it is stopped (tools/numa-vm's own default, one hour, is too short here).
test-numa: $(STAMP)
	tools/numa-vm --timeout 10800 -- python -m pytest -p no:cacheprovider -m numa --durations=0 tests/numa

clean:
	rm -rf $(VENV) build *.egg-info runs
