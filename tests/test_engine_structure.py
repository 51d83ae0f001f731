"""The backward engine's structure (docs/architecture.md), checked on the sources: one module
registers autograd hooks, the driver has no branch on a strategy, every gossip strategy is
registered by its ``intra_node`` name, and the engine imports no private name from another package
(the compiled extension is reached through ``decentpy.optim.kernels``)."""

from __future__ import annotations

import ast
import pathlib
import re

import decentpy

PACKAGE = pathlib.Path(decentpy.__file__).parent
HOOKS = re.compile(r"register_post_accumulate_grad_hook|\.register_hook\(|queue_callback")


def test_autograd_hooks_are_registered_by_the_driver_only() -> None:
    found = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if HOOKS.search(p.read_text())}
    assert found == {"engine/driver.py"}, found


def test_the_driver_does_not_branch_on_a_strategy() -> None:
    """No name, attribute or string of the driver's code (docstrings aside) speaks of a strategy."""
    tree = ast.parse((PACKAGE / "engine" / "driver.py").read_text())
    for node in ast.walk(tree):  # drop the docstrings
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined]
    words = re.compile(r"intra|shard|node|gossip|isinstance", re.IGNORECASE)
    assert not words.findall(ast.unparse(tree))


def test_one_gossip_strategy_composed_of_registered_parts() -> None:
    """One gossip strategy class; its node mode, exchange and failure policy are parts, one registry
    each, keyed by the names the wrappers take (intra_node=, compression=, the elastic wrapper)."""
    import importlib
    import pkgutil

    import decentpy.engine as engine
    from decentpy.engine import (EXCHANGES, FAILURE_POLICIES, NODE_MODES, BucketStrategy, Exchange, FailurePolicy,
                                 GossipStrategy, NodeMode)

    assert list(NODE_MODES) == ["gossip", "shard", "allreduce"]
    assert list(EXCHANGES) == ["plain", "compressed", "local-steps"] and list(FAILURE_POLICIES) == ["raise", "elastic"]
    for registry, base in ((NODE_MODES, NodeMode), (EXCHANGES, Exchange), (FAILURE_POLICIES, FailurePolicy)):
        for name, cls in registry.items():
            assert issubclass(cls, base) and cls.name == name, (name, cls)
    for mod in pkgutil.iter_modules(engine.__path__):
        importlib.import_module(f"decentpy.engine.{mod.name}")
    seen, todo = set(), [BucketStrategy]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("decentpy.") and sub not in seen:
                seen.add(sub)
                todo.append(sub)
    assert {cls.__name__ for cls in seen} == {"GossipStrategy", "ShardedGrads"}, seen
    assert GossipStrategy in seen


def test_the_engine_imports_no_private_name_from_another_package() -> None:
    bad = []
    for path in (PACKAGE / "engine").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                bad += [f"{path.name}: {alias.name}" for alias in node.names if alias.name.startswith("_")]
                if node.module and any(part.startswith("_") for part in node.module.split(".")):
                    bad.append(f"{path.name}: {node.module}")
    assert not bad, bad


def _room_imports(package: pathlib.Path, name: str) -> "dict[str, dict[str, list[str]]]":
    """Room -> room -> the importing files, for every import of the tree under ``package`` (typing-only
    imports and imports inside functions included: an arrow is an arrow). A room is a top-level
    module or sub-package; ``__init__`` is the package's face, reached by importing a name that is
    not a module of it (``decentpy._C``, the compiled extension, is a module of its own)."""
    import collections

    rooms = {p.stem for p in package.glob("*.py")} | {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    graph: "dict[str, dict[str, list[str]]]" = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in package.rglob("*.py"):
        rel = path.relative_to(package)
        here = rel.parts[0][:-3] if len(rel.parts) == 1 else rel.parts[0]
        pkg = [name, *rel.parts[:-1]]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = pkg[:len(pkg) - node.level + 1] if node.level else []
                mod = base + (node.module.split(".") if node.module else [])
                targets = [mod + [a.name] for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".") for a in node.names]
            for t in targets:
                if t[0] != name or len(t) < 2:
                    continue
                room = t[1] if t[1] in rooms else "_C" if t[1] == "_C" else "__init__"
                if room not in (here, "_C"):
                    graph[here][room].append(rel.as_posix())
    return graph


def _cycle(graph: "dict[str, dict[str, list[str]]]") -> "list[str]":
    """One cycle of rooms (empty: none)."""
    state: "dict[str, int]" = {}
    stack: "list[str]" = []

    def visit(v: str) -> "list[str]":
        state[v] = 1
        stack.append(v)
        for w in graph.get(v, {}):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        state[v] = 2
        stack.pop()
        return []

    for v in list(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return []


def test_imports_run_one_way_between_the_packages_rooms() -> None:
    """No import runs back up (docs/architecture.md, "Layers"): the rooms of decentpy/ (its top-level
    modules and sub-packages) import each other without a cycle, the package's face
    (``decentpy/__init__.py``) included -- so every room sits on a layer above everything it
    imports. Inside one room a typing-only back-reference may remain where its module says why."""
    graph = _room_imports(PACKAGE, "decentpy")
    cycle = _cycle(graph)
    assert not cycle, " -> ".join(f"{a} ({graph[a][b][0]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"
    # the layers the architecture names, lowest first: each imports only from layers below it
    for low, high in (("topology", "comm"), ("comm", "engine"), ("engine", "ddp"), ("engine", "sharding"),
                      ("ddp", "elastic")):
        assert high not in graph.get(low, {}), f"{low} imports {high}: {graph[low][high]}"
    # the optimizer and kernel layer sits on the extension alone: one pass over a bucket knows no
    # communicator, topology or strategy
    assert not graph.get("optim"), {k: v for k, v in graph.get("optim", {}).items()}
    assert not (PACKAGE / "kernels.py").exists() and (PACKAGE / "optim" / "kernels.py").is_file()


def test_bench_and_tools_depend_in_one_direction() -> None:
    """The benchmarks use the tools (the process spawner, CUDA timing, tables); no tool imports a
    benchmark."""
    root = PACKAGE.parent
    back = []
    for path in (root / "tools").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            back += [f"{path.relative_to(root)}: {m}" for m in mods if m == "bench" or m.startswith("bench.")]
    assert not back, back
