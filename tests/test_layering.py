"""The package's layers: each folder imports only the ones below it, and no two modules import
each other (directly or around a loop), lazy imports inside functions included."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatronish"
# Lowest first. A package may import only packages listed before it.
LAYERS = [
    "file_modes",
    "config",
    "distributed",
    "context_parallel",
    "tensor_parallel",
    "moe",
    "model",
    "data",
    "pipeline",
    "optim",
    "data_parallel",
    "hf",
    "checkpoint",
    "plan",
    "training",
    "train",
    "generate",
    "testing",
]


def imports() -> dict[str, set[str]]:
    """``module -> megatronish modules it imports`` (dotted names, every import statement)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[name] = _imported(ast.parse(path.read_text())) - {name}
    return graph


def _imported(tree: ast.AST) -> set[str]:
    """megatronish modules imported anywhere in ``tree`` except under ``if TYPE_CHECKING:``
    (annotations only: nothing is imported at run time)."""
    found: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatronish"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("megatronish")}
        found |= _imported(node)
    return found


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_folder_imports_only_the_layers_below_it():
    graph = imports()
    assert {layer_of(m) for m in graph} - {""} == set(LAYERS), "add the new folder to LAYERS"
    upward = [
        f"{m} imports {d}"
        for m, deps in graph.items()
        for d in deps
        if layer_of(m) and layer_of(d) and LAYERS.index(layer_of(d)) > LAYERS.index(layer_of(m))
    ]
    assert not upward, "\n".join(sorted(upward))


def test_no_module_import_cycles():
    graph = imports()
    modules = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m) :] + [m]))
        if m in done:
            return
        for d in sorted(modules[m]):
            visit(d, [*path, m])
        done.add(m)

    for m in sorted(modules):
        visit(m, [])
