"""Let a CUDA build of torchvision import beside the CPU torch (why: `parallel.cpu_compat`).

Loaded at interpreter start by one `.pth` line that `make install` writes into the CPU venv, so
it holds for every process there (rlcli, torchrun ranks, vLLM, tests, a user's own script),
whoever imports torchvision first. It costs nothing until then: the finder below waits for
`import torchvision`, and only then imports torch and `parallel.cpu_compat`.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import pathlib
import sys


class _DefineTorchvisionOps(importlib.abc.MetaPathFinder):
    """Defines torchvision's missing op schemas, then lets the normal import run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)  # once, and so that the lookup below finds the real package
        spec = importlib.util.find_spec(fullname)
        if spec is None or not spec.submodule_search_locations:
            return spec
        extensions = sorted(pathlib.Path(spec.submodule_search_locations[0]).glob("_C*.so"))
        if extensions:
            from parallel.cpu_compat import define_torchvision_op_schemas

            define_torchvision_op_schemas(str(extensions[0]))
        return spec


def install() -> None:
    if "torchvision" not in sys.modules and not any(
        isinstance(finder, _DefineTorchvisionOps) for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _DefineTorchvisionOps())


install()
