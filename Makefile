# The two quick-start commands: `make train` and `make test` (each installs what is missing).
.PHONY: install install-test train test test-fast

install:
	./scripts/install.sh

install-test:
	./scripts/install.sh --test

train: install
	./run_train.sh

test: install-test
	python3 -m pytest -q --durations=10 tests

# The inner loop: everything in-process and quick (times: tests/README.md); CI runs `make test`, all of it.
test-fast: install-test
	python3 -m pytest -q -m "not slow and not multiprocess" tests
