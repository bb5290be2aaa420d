"""The package's frame: its modules import one another one way, with no circle."""

import ast
import pathlib

import pytest

import microbatching

PACKAGE = pathlib.Path(microbatching.__file__).parent


def imports(source: str) -> set[str]:
    """The package's modules that ``source`` imports, anywhere in it: at the top, inside a
    function, or under ``TYPE_CHECKING`` (a type checker follows that import too)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1:
                base = module
            elif module.split(".")[0] == "microbatching":
                base = module.removeprefix("microbatching").lstrip(".")
            else:
                continue
            found.update([base.split(".")[0]] if base else [alias.name for alias in node.names])
        elif isinstance(node, ast.Import):
            found.update(
                alias.name.split(".")[1]
                for alias in node.names
                if alias.name.startswith("microbatching.")
            )
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module of the package, with the package's modules it imports."""
    return {path.stem: imports(path.read_text()) for path in sorted(PACKAGE.glob("*.py"))}


def check_acyclic(graph: dict[str, set[str]]) -> None:
    """Raises if some module imports, through others, itself: then no order of the modules
    has every import point down, and one of them imports a module above it."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            circle = " -> ".join([*path[path.index(module) :], module])
            raise ValueError(
                f"the modules of microbatching import one another in a circle: {circle}; "
                "move what the lower module needs into it (or below both), so that imports "
                "run one way."
            )
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_the_package_imports_in_one_direction():
    graph = import_graph()
    assert {"_typing", "_accumulators", "_grad"} <= set(graph)
    assert "_accumulators" in graph["_grad"]
    check_acyclic(graph)


def test_the_lowest_rooms_import_none_of_the_package():
    graph = import_graph()
    assert graph["_typing"] == set()
    assert graph["_sharding"] == set()


def test_a_circle_is_named_module_by_module():
    graph = {"_a": {"_b"}, "_b": {"_c"}, "_c": {"_a"}, "_d": {"_a"}}
    with pytest.raises(ValueError, match=r"in a circle: _a -> _b -> _c -> _a; move what"):
        check_acyclic(graph)


def test_an_import_under_type_checking_counts():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._a import A\n"
    assert imports(source) == {"_a"}
    assert imports("def f():\n    from . import _b, _c\n") == {"_b", "_c"}
    absolute = (
        "import microbatching._d\nfrom microbatching._e import E\nfrom microbatching import _f\n"
    )
    assert imports(absolute) == {"_d", "_e", "_f"}
