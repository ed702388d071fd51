"""The API reference's parameter tables tell the truth about defaults.

The reference (docs/api/*.md, mkdocstrings) renders each docstring's ``Args:`` section as a table
whose Default column comes from the signature, matched by the entry's name: an entry that names no
parameter (``a / b:``, ``a, b:``) shows "required" however the parameter defaults. Every public
function, class and public method of the packages the reference covers is read here as mkdocstrings
reads it (griffe, Google style) and compared with the signature Python sees.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import griffe
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["jaxdist", "jaxdist.costs", "jaxdist.strategies", "jaxdist.replicate",
            "jaxdist.gradients", "jaxdist.tpu",
            "jaxdist.training", "jaxdist.strategies.compat", "jaxdist.nn"]


def documented_objects() -> list[griffe.Object]:
    """Every public function and class the reference renders, and their public methods (griffe's
    view)."""
    loader = griffe.GriffeLoader(search_paths=[str(ROOT)], docstring_parser=griffe.Parser.google,
                                 docstring_options={"warn_unknown_params": False,
                                                    "warn_missing_types": False})
    root = loader.load("jaxdist")
    loader.resolve_aliases(implicit=False, external=False)
    found: dict[str, griffe.Object] = {}

    def visit(obj: griffe.Object) -> None:
        if obj.path in found or not (obj.is_function or obj.is_class):
            return
        found[obj.path] = obj
        if obj.is_class:
            for name, member in obj.members.items():
                if not name.startswith("_"):
                    target = member.final_target if member.is_alias else member
                    # not what a base class from elsewhere documents
                    if target.path.startswith("jaxdist."):
                        visit(target)

    for package in PACKAGES:
        prefix = package.removeprefix("jaxdist").lstrip(".")
        for name in importlib.import_module(package).__all__:
            obj = root[f"{prefix}.{name}" if prefix else name]
            visit(obj.final_target if obj.is_alias else obj)
    return list(found.values())


def runtime_signature(path: str) -> inspect.Signature | None:
    try:
        return inspect.signature(pkgutil.resolve_name(path))
    except (TypeError, ValueError, ImportError, AttributeError):  # no signature Python can give
        return None


def table_problems(obj: griffe.Object) -> list[str]:
    """What the reference's parameter table of ``obj`` gets wrong about a default."""
    if obj.docstring is None:
        return []
    params = obj.parameters
    signature = runtime_signature(obj.path)
    problems = []
    for section in obj.docstring.parsed:
        if section.kind is not griffe.DocstringSectionKind.parameters:
            continue
        for entry in section.value:
            name = entry.name.lstrip("*")
            if name not in params:
                problems.append(f"{obj.path}: Args entry {entry.name!r} names no parameter of the "
                                "signature, so the reference shows it without its default: give "
                                "each parameter an entry of its own")
                continue
            if params[name].kind in (griffe.ParameterKind.var_positional,
                                     griffe.ParameterKind.var_keyword):
                continue
            if (entry.default is None) != (params[name].default is None):
                problems.append(f"{obj.path}: {name}'s default in the table ({entry.default}) is "
                                f"not the signature's ({params[name].default})")
            if signature is None or name not in signature.parameters or entry.default is None:
                continue
            try:
                shown = ast.literal_eval(str(entry.default))
            except (ValueError, SyntaxError):
                # an expression (a constant's name): griffe shows it as written
                continue
            actual = signature.parameters[name].default
            if (actual is inspect.Parameter.empty or shown != actual
                    or type(shown) is not type(actual)):
                problems.append(f"{obj.path}: {name} shows default {entry.default} but defaults to "
                                f"{actual!r}")
    return problems


@pytest.fixture(scope="module")
def objects():
    return documented_objects()


def test_every_documented_parameter_shows_the_signatures_default(objects):
    assert len(objects) > 200  # the reference's objects were found at all
    problems = [p for obj in objects for p in table_problems(obj)]
    assert not problems, "\n".join(problems)


def test_the_trainers_key_options_show_their_defaults(objects):
    (trainer,) = [o for o in objects if o.path == "jaxdist.training.trainer.Trainer"]
    entries = {e.name: e for s in trainer.docstring.parsed if s.kind.value == "parameters"
               for e in s.value}
    assert (str(entries["input_key"].default), str(entries["target_key"].default)) == ("'x'", "'y'")


def test_an_entry_for_two_parameters_is_found():
    fake = griffe.Function("f", parameters=griffe.Parameters(
        griffe.Parameter("a", default="1"), griffe.Parameter("b", default="2")))
    fake.docstring = griffe.Docstring("Doc.\n\nArgs:\n    a / b: the two.\n", parent=fake,
                                      parser="google")
    (problem,) = table_problems(fake)
    assert "'a / b' names no parameter" in problem
