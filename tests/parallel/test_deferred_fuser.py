"""The import hook of `parallel`: megatron-core's fused functions compile when first called."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

import parallel


def test_a_fused_function_compiles_once_on_its_first_call(monkeypatch):
    compiled: list = []

    def fake_compile(function):
        compiled.append(function)
        return lambda *args: function(*args) * 10

    monkeypatch.setattr(torch, "compile", fake_compile)

    def add(a, b):
        return a + b

    fused = parallel._compile_when_first_called(add)
    assert compiled == [] and fused.__name__ == "add"
    assert fused(1, 2) == 30 and fused(2, 2) == 40
    assert compiled == [add]


def test_megatron_fuses_lazily_and_the_fused_function_equals_the_plain_one():
    probe = textwrap.dedent(
        """
        import rlcli.train.build
        import megatron.core.jit as jit
        from megatron.core.fusions import fused_bias_gelu
        print(jit.jit_fuser.__name__, fused_bias_gelu.bias_gelu.__wrapped__.__name__)
        x, bias = __import__('torch').randn(4, 8), __import__('torch').randn(8)
        eager = fused_bias_gelu.bias_gelu.__wrapped__(bias, x)
        fused = fused_bias_gelu.bias_gelu(bias, x)
        print(bool((fused - eager).abs().max() < 1e-6))
        """
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", probe], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = out.stdout.split("\n")[:2]
    assert before == "_compile_when_first_called bias_gelu"  # wrapped, not yet compiled
    assert after == "True"  # compiled on its first call, equal to the plain function
