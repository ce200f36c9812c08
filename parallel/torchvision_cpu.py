"""Let a CUDA build of torchvision import beside the CPU torch (the patch: `parallel.cpu_compat`).

Loaded at interpreter start by one `.pth` line that `make install` writes into the CPU venv, so
it holds for every process there (rlcli, torchrun ranks, vLLM, tests, a user's own script),
whoever imports torchvision first. It costs nothing until then: the hook waits for
`import torchvision`, and only then imports torch and `parallel.cpu_compat`. (Importing it
imports the `parallel` package, whose own hook on megatron-core then holds in those processes
too: it only changes anything on CPU.)

Why: torchvision (transformers' Qwen2-VL image processor, and vLLM's Qwen2.5-VL / Qwen3-VL /
Qwen3.5 models, which import it): the package index serves only CUDA builds of torchvision, whose
C++ extension (`torchvision/_C.so`) links against CUDA torch's libraries and cannot load beside
the CPU torch; no CPU build is reachable from the registries. torchvision runs without its
extension by design (`torchvision.extension._has_ops()` is then False, and the ops that need it
raise its own "Couldn't load custom C++ ops" error), except that its `_meta_registrations`
registers fake kernels for `torchvision::nms` and `qnms` whatever `_has_ops()` says, which
fails ("operator torchvision::nms does not exist") and aborts `import torchvision`.
`parallel.cpu_compat.define_torchvision_op_schemas()` defines those two schemas (no kernel) when,
and only when, the extension does not load, so the pure-Python transforms the image processors
use work and nms still refuses to run.
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
