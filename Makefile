# Everything a fresh machine with only Python needs: `make demo`, `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
NPROC ?= 2

.PHONY: install demo test test-unit test-compat lint bench clean

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

# Two workers (pytest-xdist), a test file each at a time: a file's module fixtures launch the
# jobs its tests share. Most tests wait on processes they start, so two workers keep 2 cores
# busier (measured on 2 cores: 1263 s of pytest alone, 1104 s with two workers). More workers
# than cores would crowd the jobs whose tests bound their own time.
# The repository's own modules are compiled to bytecode first: where PYTHONDONTWRITEBYTECODE is
# set (this machine's environment sets it) no process caches what it compiles, and every rank
# process of the suite compiled fsdpcheck again (0.25 s of CPU for fsdpcheck's audit, run and
# watch imports, measured; the whole suite: 24.1 CPU-min of user time, 24.5 and 25.0 without).
TEST_WORKERS ?= 2
test: install
	-$(BIN)/python -m compileall -q fsdpcheck tests examples scripts
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The fast tier: pure tests, no processes, seconds.
test-unit: install
	$(BIN)/python -m pytest -q tests/unit

# The newest torch and transformers, in a venv of their own (.venv-compat): the unit tier and
# the step, state and audit multi-rank files. Everything else stays at constraints.txt's pins.
# torch is a CPU build (a `+cpu` local version, from PyTorch's own CPU wheels): PyPI's Linux
# torch wheel is the CUDA build and pulls gigabytes of NVIDIA libraries, which this target
# never installs. Where that CPU wheel lives is the caller's to say, in COMPAT_TORCH_FROM (pip
# arguments: --index-url URL, or --find-links DIR); where pip cannot find it, the target stops
# and says so. Another pair: make test-compat COMPAT_TORCH=torch==2.14.1+cpu
# COMPAT_TRANSFORMERS=transformers==5.24.0. Where no CPU wheel can be reached, PyPI's build
# runs on CPU too, with its NVIDIA libraries (about 3 GB; a pip config that caps torch needs
# PIP_CONFIG_FILE=/dev/null): make test-compat COMPAT_TORCH=torch==2.15.0 COMPAT_TORCH_DEPS=
COMPAT_TORCH_DEPS ?= --no-deps
COMPAT_VENV := .venv-compat
COMPAT_BIN := $(COMPAT_VENV)/bin
COMPAT_TORCH ?= torch==2.15.0+cpu
COMPAT_TRANSFORMERS ?= transformers==5.25.0
COMPAT_TORCH_FROM ?=
COMPAT_TESTS := tests/unit tests/ranks/test_step.py tests/ranks/test_state_ranks.py \
	tests/ranks/test_audit.py

test-compat:
	test -x $(COMPAT_BIN)/python || $(PYTHON) -m venv $(COMPAT_VENV)
	grep -v -e '^torch==' -e '^transformers==' constraints.txt > $(COMPAT_VENV)/constraints.txt
	$(COMPAT_BIN)/python -m pip install --quiet --disable-pip-version-check --only-binary torch \
		$(COMPAT_TORCH_DEPS) $(COMPAT_TORCH_FROM) '$(COMPAT_TORCH)' || { echo "test-compat: no CPU \
	wheel for '$(COMPAT_TORCH)' here; give its index or folder in COMPAT_TORCH_FROM (pip \
	arguments), or choose another with COMPAT_TORCH=torch==VERSION+cpu"; exit 1; }
	$(COMPAT_BIN)/python -m pip install --quiet --disable-pip-version-check \
		-c $(COMPAT_VENV)/constraints.txt '$(COMPAT_TRANSFORMERS)' -e '.[dev]'
	$(COMPAT_BIN)/python -c "import torch, transformers; \
		print('test-compat: torch', torch.__version__, '· transformers', transformers.__version__)"
	$(COMPAT_BIN)/python -m pytest -q $(COMPAT_TESTS)

lint: install
	$(BIN)/ruff check fsdpcheck tests scripts examples
	$(BIN)/ruff format --check fsdpcheck tests scripts examples

bench: install
	$(BIN)/python scripts/bench

clean:
	rm -rf $(VENV) $(COMPAT_VENV) .pytest_cache demo-report.json
