# Everything a fresh machine with only Python needs: `make demo`, `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
NPROC ?= 2

.PHONY: install demo test test-unit lint bench clean

# verl's released loader, before and after its PR #6405, for tests/cli/test_verl_loader.py:
# the wheels only (no dependencies, nothing installed), read as zip files by the test.
VERL_VERSIONS := 0.7.1 0.8.0
VERL_WHEELS := $(foreach v,$(VERL_VERSIONS),$(VENV)/verl-wheels/verl-$(v)-py3-none-any.whl)

install: $(STAMP) $(VERL_WHEELS)

$(VENV)/verl-wheels/verl-%-py3-none-any.whl: | $(STAMP)
	$(BIN)/python -m pip download --quiet --disable-pip-version-check --no-deps \
		--only-binary :all: -d $(VENV)/verl-wheels 'verl==$*'

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The embedded default (`hazard`) on two ranks with different hash seeds: a real divergence,
# every time. The audit exits 1 (findings) and torchrun returns 1 for any failing rank, so the
# demo checks the report's own verdict. torchrun's failure summary goes to $(DEMO_LOG).
DEMO_LOG := $(VENV)/demo-stderr.log
demo: install
	@rm -f demo-report.json; \
	$(BIN)/torchrun --nproc-per-node $(NPROC) -m fsdpcheck audit --model hazard --vary-hash-seed \
		--json demo-report.json 2> $(DEMO_LOG); \
	verdict=$$($(BIN)/python -c "import json; r = json.load(open('demo-report.json')); \
		print(r['verdict'], r['exit_code'])" 2>/dev/null); \
	if [ "$$verdict" != "inconsistent 1" ]; then cat $(DEMO_LOG); \
		echo "demo FAILED: expected verdict 'inconsistent', exit code 1; got '$$verdict'"; exit 1; fi; \
	echo "fsdpcheck exit code 1 (findings, as the demo expects); JSON report: demo-report.json"

test: install
	$(BIN)/python -m pytest -q

# The fast tier: pure tests, no processes, seconds.
test-unit: install
	$(BIN)/python -m pytest -q tests/unit

lint: install
	$(BIN)/ruff check fsdpcheck tests scripts examples
	$(BIN)/ruff format --check fsdpcheck tests scripts examples

bench: install
	$(BIN)/python scripts/bench

clean:
	rm -rf $(VENV) .pytest_cache demo-report.json
