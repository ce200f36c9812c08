"""Let a CUDA build of torchvision import beside the CPU torch (why: `parallel.cpu_compat`).

Loaded at interpreter start by one `.pth` line that `make install` writes into the CPU venv, so
it holds for every process there (rlcli, torchrun ranks, vLLM, tests, a user's own script),
whoever imports torchvision first. It costs nothing until then: the hook waits for
`import torchvision`, and only then imports torch and `parallel.cpu_compat`. (Importing it
imports the `parallel` package, whose own hook on megatron-core then holds in those processes
too: it only changes anything on CPU.)
"""

from __future__ import annotations

import pathlib

from parallel import OnFirstImport


def _define_missing_ops(spec) -> None:
    """Before torchvision's own code runs: its op schemas, when its extension cannot load."""
    if not spec.submodule_search_locations:
        return
    extensions = sorted(pathlib.Path(spec.submodule_search_locations[0]).glob("_C*.so"))
    if extensions:
        from parallel.cpu_compat import define_torchvision_op_schemas

        define_torchvision_op_schemas(str(extensions[0]))


OnFirstImport.install("torchvision", before=_define_missing_ops)
