"""The package's layering, read from its source: the paper's algorithm (`spec`) imports neither the
CPU backend nor the drafting policy, nothing imports in a circle, and no function-local import
hides one."""

import ast
from pathlib import Path

import pytest

import eaglespec

ROOT = Path(eaglespec.__file__).parent
# layer -> the layers its modules may import (besides their own); `errors` and `io` are leaves
ALLOWED = {
    "platform": set(),
    "errors": set(),
    "io": set(),
    "spec": {"errors", "io"},
    "cpu": {"spec", "platform", "errors", "io"},
    "policy": {"spec", "platform", "errors", "io"},
    "models": {"spec", "cpu", "policy", "platform", "errors", "io"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(module: str, is_package: bool, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The eaglespec modules an import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "eaglespec"]
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level:
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "eaglespec":
        return []
    out = []
    for alias in node.names:  # `from . import kernels` names a module; `from .x import f` names x
        sub = f"{target}.{alias.name}"
        out.append(sub if (ROOT.parent / Path(*sub.split("."))).with_suffix(".py").exists()
                   or (ROOT.parent / Path(*sub.split(".")) / "__init__.py").exists() else target)
    return out


def imports() -> dict[str, list[tuple[str, bool, bool]]]:
    """module -> (imported module, at function level, only under TYPE_CHECKING) for every import."""
    graph = {}
    for path in ROOT.rglob("*.py"):
        module = module_name(path)
        tree = ast.parse(path.read_text())
        found = []

        def walk(node, in_function=False, type_only=False):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in resolve(module, path.name == "__init__.py", child):
                        found.append((target, in_function, type_only))
                checking = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
                walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)),
                     type_only or checking)

        walk(tree)
        graph[module] = found
    return graph


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "eaglespec"


def test_layers_import_only_what_lies_below_them():
    wrong = [(m, t) for m, found in imports().items() for t, _, _ in found
             if layer(m) in ALLOWED and layer(t) != layer(m) and layer(t) not in ALLOWED[layer(m)]]
    assert not wrong, f"imports across the layering: {wrong}"


def test_no_import_cycle():
    graph = {m: {t for t, _, type_only in found if not type_only and t != m} for m, found in imports().items()}
    # a package's __init__ re-exports its modules: an edge from a module to its own package's
    # __init__ would be a cycle, so it is one
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_lower_layers_import_at_module_level():
    """A function-local import in the library's layers would hide a cycle from the check above
    (the CLI and the benchmark import lazily for start-up time: they are on top)."""
    local = [(m, t) for m, found in imports().items() for t, in_function, _ in found
             if in_function and layer(m) in ALLOWED]
    assert not local, f"function-local imports: {local}"


def test_no_state_of_ours_in_model_config():
    """What eaglespec does to a model is carried by typed objects, not by `model.config` attributes."""
    hits = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if "config.eaglespec_" in p.read_text()]
    assert not hits


def test_the_checks_see_a_cycle_and_a_crossing(tmp_path, monkeypatch):
    """The graph above is real: a planted spec -> cpu import and a cycle are found."""
    pkg = tmp_path / "eaglespec"
    for sub in ("spec", "cpu"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "spec" / "a.py").write_text("from ..cpu import b\n")
    (pkg / "cpu" / "b.py").write_text("from ..spec import a\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    with pytest.raises(AssertionError, match="across the layering"):
        test_layers_import_only_what_lies_below_them()
    with pytest.raises(pytest.fail.Exception, match="import cycle"):
        test_no_import_cycle()
