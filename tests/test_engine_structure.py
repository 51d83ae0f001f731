"""The backward engine's structure (docs/architecture.md), checked on the sources: one module
registers autograd hooks, the driver has no branch on a strategy, every gossip strategy is
registered by its ``intra_node`` name, and the engine imports no private name from another package
(the compiled extension is reached through ``decentpy.kernels``)."""

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
    assert list(EXCHANGES) == ["plain", "compressed"] and list(FAILURE_POLICIES) == ["raise", "elastic"]
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
