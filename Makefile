# moescope: `make test` and `make demo` each set everything up first (idempotent).
VENV    ?= .venv
PY      := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup install test lint demo bench fuzz clean help

help:
	@echo "make setup    install system packages, kernel headers, venv, project (idempotent, root)"
	@echo "make install  setup + put 'agent' on root's PATH (/usr/local/bin/agent)"
	@echo "make test     setup + run the whole test suite (BPF tests must run: needs root)"
	@echo "make lint     setup + the ruff and mypy gates alone (they also run inside make test)"
	@echo "make demo     setup + reference MoE runtime under load with the agent and its TUI"
	@echo "make bench    setup + overhead benchmarks (JSON under bench-results/)"
	@echo "make fuzz     setup + the fuzz tests with the long hypothesis profile (minutes)"

setup:
	bash scripts/setup.sh

install: setup
	ln -sfn "$(CURDIR)/$(VENV)/bin/agent" /usr/local/bin/agent
	@echo "agent installed: /usr/local/bin/agent -> $(CURDIR)/$(VENV)/bin/agent"

test: setup
	MOESCOPE_REQUIRE_BPF=1 $(PY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(PY) -m pytest -q tests/test_lint_and_types.py

demo: setup
	bash scripts/demo.sh

bench: setup
	$(PY) -m benchmarks.run_all $(BENCH_ARGS)

fuzz: setup
	HYPOTHESIS_PROFILE=long $(PY) -m pytest tests/fuzz -q --hypothesis-show-statistics $(PYTEST_ARGS)

clean:
	rm -rf build *.egg-info bench-results
