"""The package's import graph: a tree of layers, with no circle (imports inside functions count
too)."""

import ast
import functools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jaxdist"
# bottom up
LAYERS = ["costs", "replicate", "job", "strategies", "gradients", "nn", "tpu", "training"]


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # parsed once per run (every test reads the same graph; none changes it)
def _graph() -> dict[str, frozenset[str]]:
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):  # every import, at any depth
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return {m: frozenset(deps) for m, deps in graph.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*stack[stack.index(n):], n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle():
    graph = {m: {n for n in deps if not m.startswith(n + ".") and n != "jaxdist"}
             for m, deps in _graph().items()}
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


@pytest.mark.parametrize("layer", LAYERS)
def test_layers_import_down_only(layer):
    above = LAYERS[LAYERS.index(layer) + 1:]
    for module, deps in _graph().items():
        if module.startswith(f"jaxdist.{layer}"):
            upward = sorted(d for d in deps if any(d.startswith(f"jaxdist.{a}") for a in above))
            assert not upward, f"{module} imports {upward}, a layer above {layer}"


# strategies/, bottom up
ROOMS = ["ambient", "layout", "input", "plan", "replica_context", "compile", "tf_api"]


@pytest.mark.parametrize("room", ROOMS)
def test_strategy_rooms_import_down_only(room):
    """Each room of ``strategies/`` imports only the rooms below it, never the strategy classes and
    public faces at the top of the package (which import the rooms)."""
    own = f"jaxdist.strategies.{room}"
    below = {f"jaxdist.strategies.{r}" for r in ROOMS[:ROOMS.index(room)]}
    for module, deps in _graph().items():
        if module == own or module.startswith(own + "."):
            wrong = sorted(
                d for d in deps if d.startswith("jaxdist.strategies.") and not d.startswith(own)
                and not any(d == b or d.startswith(b + ".") for b in below)
            )
            assert not wrong, (
                f"{module} imports {wrong}: a room above {room}, or the top of strategies/"
            )


def test_other_packages_use_the_rooms_interfaces():
    """Outside its room nothing imports a room's private modules (the other rooms, the strategy
    classes and the public faces at the top of ``strategies/``, the other packages): each room's
    ``__init__`` is its interface, ``jaxdist.job``'s too."""
    for module, deps in _graph().items():
        private = sorted(d for d in deps if d.startswith(("jaxdist.strategies.", "jaxdist.job."))
                         and "._" in d
                         and not (module + ".").startswith(d.rsplit("._", 1)[0] + "."))
        assert not private, (
            f"{module} imports {private}; import the room (jaxdist.strategies.<room>) instead"
        )


# a room inside a room: its own interface, below the rest of its room
SUBROOMS = {"compile._trace": "compile"}


@pytest.mark.parametrize("subroom", sorted(SUBROOMS))
def test_subrooms_import_down_only(subroom):
    """A room inside a room (``compile/_trace``: what runs while a ``strategy.jit`` step traces)
    imports only the rooms below its room, never the rest of its own room; and nothing outside its
    room imports it at all (its ``__init__`` is the interface its room uses)."""
    own = f"jaxdist.strategies.{subroom}"
    room = f"jaxdist.strategies.{SUBROOMS[subroom]}"
    graph = _graph()
    assert own in graph, f"{own} is no package"
    for module, deps in graph.items():
        inside = module == own or module.startswith(own + ".")
        if inside:
            sideways = sorted(d for d in deps if (d == room or d.startswith(room + "."))
                              and not (d == own or d.startswith(own + ".")))
            assert not sideways, f"{module} imports {sideways}: the rest of its room sits above it"
        elif not (module == room or module.startswith(room + ".")):
            wrong = sorted(d for d in deps if d == own or d.startswith(own + "."))
            assert not wrong, f"{module} imports {wrong}: only {room} uses its room {own}"


FOLDERS = ["callbacks", "data", "step", "checkpoints", "loop"]  # training/, bottom up


@pytest.mark.parametrize("folder", FOLDERS)
def test_training_folders_import_down_only(folder):
    """Each concept folder of ``training/`` imports only the folders below it, never the modules at
    the top of the package (the `Trainer`, ``prepare``: they import the folders)."""
    own = f"jaxdist.training.{folder}"
    below = {f"jaxdist.training.{f}" for f in FOLDERS[:FOLDERS.index(folder)]}
    graph = _graph()
    assert own in graph, f"{own} is no package"
    for module, deps in graph.items():
        if module == own or module.startswith(own + "."):
            inside = [d for d in deps if d == "jaxdist.training"
                      or d.startswith("jaxdist.training.")]
            wrong = sorted(d for d in inside if not (d == own or d.startswith(own + "."))
                           and not any(d == b or d.startswith(b + ".") for b in below))
            assert not wrong, (
                f"{module} imports {wrong}: a folder above {folder}, or the top of training/"
            )


def test_other_modules_use_the_training_folders_interfaces():
    """Outside its folder nothing imports a training folder's private modules: each folder's
    ``__init__`` is its interface."""
    for module, deps in _graph().items():
        private = sorted(d for d in deps if d.startswith("jaxdist.training.") and "._" in d
                         and not (module + ".").startswith(d.rsplit("._", 1)[0] + "."))
        assert not private, (
            f"{module} imports {private}; import the folder (jaxdist.training.<folder>) instead"
        )
