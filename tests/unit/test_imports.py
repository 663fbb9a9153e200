"""The import graph of ``structllm``: no cycles, and the front end's modules never pull in
torch (the front-end process must not hold it) nor the engine's weight loader."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.support.procs import ROOT

PACKAGE = ROOT / "structllm"


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(path: Path, known: dict[str, Path], for_types: bool = False) -> set[str]:
    """The structllm modules ``path`` imports anywhere (functions too: a lazy import is
    still an edge), but for ``if TYPE_CHECKING:`` blocks unless ``for_types``."""
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            if not for_types and (
                (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
                or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
            ):
                for n in node.orelse:
                    self.visit(n)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(a.name for a in node.names if a.name in known)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level == 0 and node.module and node.module.startswith("structllm"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    found.add(sub if sub in known else node.module)

    Visitor().visit(ast.parse(path.read_text()))
    return {m for m in found if m in known}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def import_graph(for_types: bool = False) -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known, for_types) - {name} for name, path in known.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_structllm_has_no_import_cycle() -> None:
    graph = import_graph()
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_no_import_cycle_even_for_types() -> None:
    """Nor through ``if TYPE_CHECKING:`` imports: a module that needs another's types gets
    a small interface instead (``server/pipeline.py``'s ``ChatPipeline`` for the Responses
    endpoints, ``decode_plan.plan`` handed to the model by the runner)."""
    graph = import_graph(for_types=True)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_tokenizer_finds_model_files_without_the_weight_loader() -> None:
    graph = import_graph()
    for module in ("structllm.tokenizer", "structllm.model.files"):
        assert "structllm.model.loader" not in reachable(graph, module), module
    assert "structllm.model.loader" not in graph["structllm.server.serve"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_front_end_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import structllm.cli, structllm.chat, structllm.server.serve, "
        "structllm.server.api_server\n"
        "import structllm.structured, structllm.output, structllm.tokenizer, "
        "structllm.model.files\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'structllm.model.loader') "
        "if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
