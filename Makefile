# Everything a fresh machine with only Python needs: `make demo`, `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
NPROC ?= 2

.PHONY: install demo test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The embedded default (`hazard`) on two ranks with different hash seeds: a real divergence,
# every time. The audit exits 1 (findings); the demo succeeds when it does exactly that.
# torchrun's own failure summary goes to $(DEMO_LOG), shown only if the demo goes wrong.
DEMO_LOG := $(VENV)/demo-stderr.log
demo: install
	@$(BIN)/torchrun --nproc-per-node $(NPROC) -m fsdpcheck audit --model hazard --vary-hash-seed \
		--json demo-report.json 2> $(DEMO_LOG); code=$$?; \
	if [ $$code -ne 1 ]; then cat $(DEMO_LOG); fi; \
	echo "fsdpcheck exit code $$code (1 = findings, as the demo expects); JSON report: demo-report.json"; \
	test $$code -eq 1

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check fsdpcheck tests scripts
	$(BIN)/ruff format --check fsdpcheck tests scripts

bench: install
	$(BIN)/python scripts/bench.py

clean:
	rm -rf $(VENV) .pytest_cache demo-report.json
