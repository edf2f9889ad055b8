"""The documentation runs: docstring examples as doctests, and stubs that match the extensions."""

import ast
import doctest
import importlib
from pathlib import Path

import pytest

import colibri

# the public modules whose docstrings carry examples
DOCUMENTED = [
    "colibri",
    "colibri.routing._context",
    "colibri.partition._partition",
    "colibri.pager._pager",
    "colibri.layer._moe",
]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@pytest.mark.parametrize("name", DOCUMENTED)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    failed, attempted = doctest.testmod(module, optionflags=FLAGS, verbose=False)
    assert attempted > 0, f"{name} has no examples"
    assert failed == 0, f"{failed} of {attempted} examples in {name} failed (output above)"


EXTENSIONS = ["_core", "_dlpack._capsule", "layer._ffn", "layer._norm", "layer._rows"]


@pytest.mark.parametrize("name", EXTENSIONS)
def test_stub_names_match_the_extension(name):
    module = importlib.import_module(f"colibri.{name}")
    package, _, leaf = f"colibri.{name}".rpartition(".")
    stub = Path(importlib.import_module(package).__file__).parent / f"{leaf}.pyi"
    assert stub.is_file(), f"no stub {stub.name} is installed beside colibri.{name}"
    tree = ast.parse(stub.read_text())
    declared = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            declared.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            declared.add(node.target.id)
    missing = sorted(n for n in declared if not hasattr(module, n))
    assert not missing, f"{stub.name} declares names colibri.{name} lacks: {missing}"
    public = {
        n for n, v in vars(module).items()
        if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
    }  # fmt: skip
    undeclared = sorted(public - declared)
    assert not undeclared, f"{stub.name} lacks colibri.{name}'s public names: {undeclared}"


def test_package_is_typed():
    assert Path(colibri.__file__).with_name("py.typed").is_file()
