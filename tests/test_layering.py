"""The package's layers: each folder imports only the ones below it, and no two modules import
each other (directly or around a loop), lazy imports inside functions included; in the typed
layers every parameter has a type, so none takes an object of a higher layer unseen."""

import ast
import builtins
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatronish"
# Lowest first. A package may import only packages listed before it.
LAYERS = [
    "file_modes",
    "config",
    "spec",
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


def imports(annotations: bool = False) -> dict[str, set[str]]:
    """``module -> megatronish modules it imports`` (dotted names, every import statement;
    those under ``if TYPE_CHECKING:`` only with ``annotations``)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[name] = _imported(ast.parse(path.read_text()), annotations) - {name}
    return graph


def _imported(tree: ast.AST, annotations: bool) -> set[str]:
    """megatronish modules imported anywhere in ``tree``; under ``if TYPE_CHECKING:`` (nothing
    imported at run time) only with ``annotations``."""
    found: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            if not annotations:
                continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatronish"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("megatronish")}
        found |= _imported(node, annotations)
    return found


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_folder_imports_only_the_layers_below_it():
    """Annotation-only imports included: a type from a higher layer is an upward dependency."""
    graph = imports(annotations=True)
    assert {layer_of(m) for m in graph} - {""} == set(LAYERS), "add the new folder to LAYERS"
    upward = [
        f"{m} imports {d}"
        for m, deps in graph.items()
        for d in deps
        if layer_of(m) and layer_of(d) and LAYERS.index(layer_of(d)) > LAYERS.index(layer_of(m))
    ]
    assert not upward, "\n".join(sorted(upward))


def test_no_module_import_cycles():
    """Run-time imports only: within a folder, ``if TYPE_CHECKING:`` may name a module that
    imports this one."""
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


# -- typed parameters -----------------------------------------------------------------------------
# Layers whose every parameter (and dataclass field) has a type. With the rule above, which counts
# annotation-only imports, that type comes from the layer itself or one below: an object of a
# higher layer (a trainer passed down and read inside) cannot hide in an unannotated name.
# Not yet: data (a preprocessing helper formats any cell a dataset yields: ``object`` is its
# only true type), and the layers above checkpoint, which no lower layer is handed.
UNTYPED_LAYERS = {"data", "plan", "training", "train", "testing"}
TYPED_LAYERS = [layer for layer in LAYERS if layer not in UNTYPED_LAYERS]
VAGUE = {"Any", "object"}  # says nothing of what is read: only ``*args`` / ``**kwargs`` may


def annotation_problems(tree: ast.Module) -> list[str]:
    """The parameters of ``tree``'s functions (methods, private and nested ones too; not ``self``
    or ``cls``) and its classes' fields that are not annotated, are annotated ``Any`` or
    ``object`` (``*args`` and ``**kwargs`` may be), or name a type the module neither defines
    nor imports."""
    bound = _module_names(tree) | set(dir(builtins))
    typed: list[tuple[str, ast.expr | None, bool]] = []  # (where, annotation, vague allowed)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            typed += [
                (f"{node.name}.{s.target.id} line {s.lineno}", s.annotation, False)
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            ]
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        named = [*a.posonlyargs, *a.args, *a.kwonlyargs]
        if named and named[0].arg in ("self", "cls"):
            named = named[1:]
        stars = [p for p in (a.vararg, a.kwarg) if p is not None]
        for arg in [*named, *stars]:
            where = f"{node.name}({arg.arg}) line {node.lineno}"
            typed.append((where, arg.annotation, arg in stars))
    problems = []
    for where, annotation, vague_ok in typed:
        if annotation is None:
            problems.append(f"{where}: not annotated")
            continue
        if not vague_ok and _last_name(_parsed(annotation)) in VAGUE:
            problems.append(f"{where}: annotated {_last_name(_parsed(annotation))}")
        if unknown := sorted(_names(annotation) - bound):
            problems.append(f"{where}: {', '.join(unknown)} neither defined nor imported")
    return problems


def _parsed(annotation: ast.expr) -> ast.expr:
    """A string annotation as the expression it holds."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return ast.parse(annotation.value, mode="eval").body
    return annotation


def _last_name(annotation: ast.expr) -> str | None:
    """``Any`` for ``Any`` and ``typing.Any``; None for anything but a plain name."""
    if isinstance(annotation, ast.Attribute):
        return annotation.attr
    return annotation.id if isinstance(annotation, ast.Name) else None


def _names(annotation: ast.expr) -> set[str]:
    """The names an annotation uses (inside quoted parts too, not inside ``Literal[...]``)."""
    node = _parsed(annotation)
    if isinstance(node, ast.Subscript) and _last_name(node.value) == "Literal":
        return _names(node.value)
    if isinstance(node, ast.Name):
        return {node.id}
    found: set[str] = set()
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.expr):
            found |= _names(child)
    return found


def _module_names(tree: ast.Module) -> set[str]:
    """Names bound at module level (inside ``if`` and ``try`` blocks too)."""
    names: set[str] = set()
    todo = list(tree.body)
    while todo:
        s = todo.pop()
        if isinstance(s, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in s.names}
        elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(s.name)
        elif isinstance(s, (ast.Assign, ast.AnnAssign)):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(s, (ast.If, ast.Try)):
            todo += [*s.body, *s.orelse, *getattr(s, "finalbody", [])]
            todo += [b for h in getattr(s, "handlers", []) for b in h.body]
    return names


def layer_files(layer: str) -> list[Path]:
    """The modules of a folder layer, or the one module a single-file layer is."""
    folder = PACKAGE / layer
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [PACKAGE / f"{layer}.py"]


def test_typed_layers_type_every_parameter():
    problems = [
        f"{path.relative_to(PACKAGE.parent)}: {problem}"
        for layer in TYPED_LAYERS
        for path in layer_files(layer)
        for problem in annotation_problems(ast.parse(path.read_text()))
    ]
    assert not problems, "\n".join(problems)


# A checkpoint module as it was (``load_into(trainer, ...)`` reading the trainer's insides), and
# the ways around the rules that they catch.
DUCK_TYPED = """
def load_into(trainer, path: str) -> None:
    trainer.state.step = 0
"""
TYPED_FROM_ABOVE = """
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatronish.training.trainer import Trainer

def load_into(trainer: Trainer, path: str) -> None: ...
"""
VAGUELY_TYPED = """
from typing import Any
def load_into(trainer: Any, path: "str") -> None: ...
def save(trainer: "Trainer") -> None: ...
class Saver:
    trainer: object
"""
TYPED_BELOW = """
from typing import Literal
from megatronish.checkpoint.parts import CheckpointParts
def load_into(parts: CheckpointParts, mode: "Literal['fast']", *args: object, **kw: object): ...
class Saver:
    parts: CheckpointParts
    def __init__(self, parts: CheckpointParts) -> None: ...
"""


def test_the_rules_catch_a_duck_typed_object_of_a_higher_layer():
    assert annotation_problems(ast.parse(DUCK_TYPED)) == [
        "load_into(trainer) line 2: not annotated"
    ]
    assert annotation_problems(ast.parse(TYPED_FROM_ABOVE)) == []  # but its import is upward:
    above = _imported(ast.parse(TYPED_FROM_ABOVE), annotations=True)
    assert above == {"megatronish.training.trainer"}
    assert LAYERS.index(layer_of(above.pop())) > LAYERS.index("checkpoint")
    assert sorted(annotation_problems(ast.parse(VAGUELY_TYPED))) == [
        "Saver.trainer line 6: annotated object",
        "load_into(trainer) line 3: annotated Any",
        "save(trainer) line 4: Trainer neither defined nor imported",
    ]
    assert annotation_problems(ast.parse(TYPED_BELOW)) == []
