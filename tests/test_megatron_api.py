"""The megatron-core API rlcli calls exists in the installed release (0.16.1 under `make test`,
0.19.2 under `make test-mcore19`): a renamed or removed name fails here, by name, before any
training test trips over it.

Read from the source (ast): every ``megatron.core`` module and name the project's packages
import, every attribute they read from an imported megatron module or object
(``parallel_state.get_tensor_model_parallel_rank``), and the keywords of each call to a megatron
function or class (``TransformerConfig(num_layers=...)``). The contracts rlcli implements for
megatron to call (SDPAttention in place of DotProductAttention, ValueHead as the output layer)
and the keywords rlcli passes through ``**kwargs`` are checked by signature. The keywords of a
call to ``get_forward_backward_func()``'s result are checked against each of its schedules.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("parallel", "rlcli", "algorithms", "benchmarks")
SCHEDULES = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)


def _sources() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.py"))


def _resolve(dotted: str):
    """The module or object a dotted name denotes (a module, or attributes of one)."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for name in parts[split:]:
            target = getattr(target, name)
        return target
    raise ModuleNotFoundError(dotted)


class _Uses(ast.NodeVisitor):
    """Collects, for one source file, the megatron names it uses (``uses``: dotted name ->
    first line) and the keywords of its calls to them (``calls``: dotted name -> keywords)."""

    def __init__(self) -> None:
        self.bound: dict[str, str] = {}  # local name -> dotted megatron name
        self.schedules: set[str] = set()  # local names holding get_forward_backward_func()
        self.uses: dict[str, int] = {}
        self.calls: list[tuple[str, set[str], int]] = []

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.startswith("megatron.core"):
                self.uses.setdefault(alias.name, node.lineno)
                if alias.asname:
                    self.bound[alias.asname] = alias.name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.module.startswith("megatron.core"):
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                self.uses.setdefault(dotted, node.lineno)
                self.bound[alias.asname or alias.name] = dotted

    def dotted(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.bound.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.dotted(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = self.dotted(node)
        if dotted and isinstance(node.ctx, ast.Load):
            self.uses.setdefault(dotted, node.lineno)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        value = node.value
        if isinstance(value, ast.Call) and (self.dotted(value.func) or "").endswith(
            ".get_forward_backward_func"
        ):
            self.schedules |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        keywords = {k.arg for k in node.keywords if k.arg is not None}
        func = node.func
        targets = [func.body, func.orelse] if isinstance(func, ast.IfExp) else [func]
        for target in targets:
            dotted = self.dotted(target)
            if dotted:
                self.calls.append((dotted, keywords, node.lineno))
        is_schedule = (isinstance(func, ast.Name) and func.id in self.schedules) or (
            isinstance(func, ast.Call)
            and (self.dotted(func.func) or "").endswith(".get_forward_backward_func")
        )
        if is_schedule:
            for schedule in SCHEDULES:
                dotted = f"megatron.core.pipeline_parallel.schedules.{schedule}"
                self.calls.append((dotted, keywords, node.lineno))
        self.generic_visit(node)


def _collect() -> tuple[dict[str, str], list[tuple[str, set[str], str]]]:
    uses: dict[str, str] = {}
    calls: list[tuple[str, set[str], str]] = []
    for path in _sources():
        visitor = _Uses()
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        rel = path.relative_to(REPO)
        for dotted, line in visitor.uses.items():
            uses.setdefault(dotted, f"{rel}:{line}")
        calls += [(dotted, kw, f"{rel}:{line}") for dotted, kw, line in visitor.calls if kw]
    return uses, calls


USES, CALLS = _collect()


def test_the_project_uses_megatron_core():
    """The collection itself works: the names every training run needs are among them."""
    for name in (
        "megatron.core.parallel_state.initialize_model_parallel",
        "megatron.core.transformer.TransformerConfig",
        "megatron.core.optimizer.get_megatron_optimizer",
        "megatron.core.dist_checkpointing.save",
    ):
        assert name in USES, sorted(USES)
    assert any(name.endswith("TransformerConfig") for name, _, _ in CALLS)


@pytest.mark.parametrize("name", sorted(USES))
def test_every_megatron_name_the_project_uses_exists(name):
    try:
        _resolve(name)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"{name} (used at {USES[name]}) is missing in megatron-core: {error}")


def _parameters(target) -> tuple[set[str], bool]:
    """The keyword names ``target`` accepts and whether it takes **kwargs."""
    signature = inspect.signature(target)
    params = signature.parameters.values()
    return {p.name for p in params}, any(p.kind is p.VAR_KEYWORD for p in params)


@pytest.mark.parametrize(
    "name, keywords, where",
    CALLS,
    ids=[f"{where}-{name.rsplit('.', 1)[-1]}" for name, _, where in CALLS],
)
def test_every_keyword_the_project_passes_is_a_parameter(name, keywords, where):
    try:
        target = _resolve(name)
    except (ImportError, AttributeError):
        pytest.skip(f"{name}: reported by test_every_megatron_name_the_project_uses_exists")
    if not callable(target):
        pytest.skip(f"{name} is not callable")
    try:
        accepted, any_keyword = _parameters(target)
    except (TypeError, ValueError):
        pytest.skip(f"{name}: no signature to read")
    unknown = sorted(keywords - accepted)
    assert any_keyword or not unknown, f"{where}: {name} takes no {unknown}"


def test_gpt_model_takes_the_rope_keywords_rlcli_passes():
    """``parallel.rope.rope_model_kwargs`` builds these; the call site passes them as **kwargs."""
    from megatron.core.models.gpt import GPTModel

    accepted, _ = _parameters(GPTModel.__init__)
    for name in ("position_embedding_type", "rotary_base", "rope_scaling", "rope_scaling_factor"):
        assert name in accepted, name
    forward, _ = _parameters(GPTModel.forward)
    assert {"input_ids", "position_ids", "attention_mask", "packed_seq_params"} <= forward
    assert "padding_mask" in forward  # MoE routers leave padding out (parallel.schedule)


def test_sdp_attention_takes_what_megatron_passes_its_core_attention():
    """SDPAttention stands in for DotProductAttention: megatron's SelfAttention builds and calls
    it with DotProductAttention's parameters."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from parallel.attention import SDPAttention

    for method in ("__init__", "forward"):
        theirs, _ = _parameters(getattr(DotProductAttention, method))
        ours, _ = _parameters(getattr(SDPAttention, method))
        assert theirs <= ours, f"SDPAttention.{method} lacks {sorted(theirs - ours)}"


def test_value_head_takes_what_gpt_model_passes_its_output_layer():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from parallel.model import ValueHead

    theirs, _ = _parameters(ColumnParallelLinear.forward)
    ours, _ = _parameters(ValueHead.forward)
    used = {"weight", "runtime_gather_output"}  # GPTModel's output_layer(hidden, weight=..., ...)
    assert used <= theirs and used <= ours, (sorted(theirs), sorted(ours))
