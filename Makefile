# The two quick-start commands: `make train` and `make test` (each installs what is missing).
.PHONY: install install-test train test

install:
	./scripts/install.sh

install-test:
	./scripts/install.sh --test

train: install
	./run_train.sh

test: install-test
	python3 -m pytest -q tests
