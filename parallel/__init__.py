"""Megatron-core behind rlcli's types: mesh, model build, schedule, resharding, checkpoints.

Importing this package installs one import hook (`OnFirstImport`, which `parallel.torchvision_cpu`
uses too): on a machine without
CUDA, megatron-core's fusion decorator (`megatron.core.jit.jit_fuser`, which is `torch.compile`)
compiles a function when it is first called instead of wrapping it at import. `torch.compile`
only wraps at decoration time too, but its first use imports dynamo and inductor: 1.7 s of the
5.1 s it takes a process here (2-core Intel Xeon) to import the training stack, paid by every
rank, rollout worker and CLI run whether a fused kernel ever runs or not (megatron-core 0.16.1;
0.19.2's pipeline schedules import dynamo themselves, so there it saves nothing). What is
compiled, and when, does not change. On GPU the hook leaves megatron-core as it is.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys


def _compile_when_first_called(function):
    compiled = None

    @functools.wraps(function)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(function)
        return compiled(*args, **kwargs)

    return call


class OnFirstImport(importlib.abc.MetaPathFinder):
    """Runs `before(spec)` when module `fullname` is first imported (before its code runs) and
    `after(module)` once its code has run, then leaves the import machinery. Installed at most
    once per name, and only while the module is not imported yet."""

    def __init__(self, fullname, before=None, after=None) -> None:
        self.fullname, self.before, self.after = fullname, before, after

    def find_spec(self, fullname, path, target=None):
        if fullname != self.fullname:
            return None
        sys.meta_path.remove(self)  # once, and so that the lookup below finds the real module
        spec = importlib.util.find_spec(fullname)
        if spec is None:
            return None
        if self.before is not None:
            self.before(spec)
        if self.after is not None:
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)
                self.after(module)

            spec.loader.exec_module = exec_module
        return spec

    @classmethod
    def install(cls, fullname, before=None, after=None) -> None:
        if fullname in sys.modules:
            return
        if any(isinstance(f, cls) and f.fullname == fullname for f in sys.meta_path):
            return
        sys.meta_path.insert(0, cls(fullname, before, after))


def _give_megatron_the_deferring_fuser(module) -> None:
    import torch

    if not torch.cuda.is_available():
        module.jit_fuser = _compile_when_first_called


OnFirstImport.install("megatron.core.jit", after=_give_megatron_the_deferring_fuser)
