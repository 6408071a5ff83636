"""The tree's promises: a public surface that resolves, no import cycle and no private
name across the driver's modules, every table and log declared once, kernel-only
functions that refuse a call from Python instead of crashing."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import numpy as np
import pytest

import aisim_fast
from aisim_fast.engine.tables import TABLES
from aisim_fast.kernels.jit import KernelOnlyDispatcher
from aisim_fast.kernels.schema import layout as L
from support.paths import REPO_DIR

DRIVER = REPO_DIR / "aisim_fast"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_DIR).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _driver_imports() -> dict[str, set[str]]:
    """Module -> the driver modules it imports, at any level (functions included;
    ``if TYPE_CHECKING`` blocks left out: they never run)."""
    modules = {_module_name(p) for p in DRIVER.rglob("*.py")}
    graph = {}
    for path in DRIVER.rglob("*.py"):
        tree = ast.parse(path.read_text())
        type_checking = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                         and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and id(node) not in type_checking and node.module:
                for alias in node.names:
                    for name in (f"{node.module}.{alias.name}", node.module):
                        if name in modules:
                            found.add(name)
                            break
        graph[_module_name(path)] = found - {_module_name(path)}
    return graph


def test_no_import_cycle_in_the_driver():
    graph = _driver_imports()
    state: dict[str, int] = {}  # 1 = on the path, 2 = done

    def visit(module, path):
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_no_private_name_imported_across_driver_modules():
    crossing = []
    for path in DRIVER.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aisim_fast"):
                crossing += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                             if a.name.startswith("_") and not a.name.startswith("__")]
    assert not crossing, crossing


def test_the_public_surface_resolves():
    for name in aisim_fast.__all__:
        assert getattr(aisim_fast, name) is not None, name
    assert aisim_fast.load_trace is aisim_fast.load_mooncake
    with pytest.raises(AttributeError):
        aisim_fast.not_a_name  # noqa: B018


def test_every_column_is_a_named_constant_of_its_table():
    tables = [v for v in vars(L).values() if isinstance(v, L.FieldTable)]
    assert {t.prefix for t in tables} >= {"CFG_", "PW_", "RQ_", "WK_", "SM_", "PL_", "EV_", "HL_", "RL_", "ACC_"}
    for table in tables:
        L.check_constants(table, vars(L))
    assert "globals().update" not in (REPO_DIR / "kernels" / "schema" / "layout.py").read_text()
    # a constant out of step with its table is refused
    with pytest.raises(ImportError, match="out of step"):
        L.check_constants(L.PASS_LOG, {**vars(L), "PL_END_MS": L.PL_START_MS})


def test_kernel_only_functions_refuse_a_call_from_python():
    busy_heap = importlib.import_module("aisim_fast.kernels.loop.busy_heap")
    assert isinstance(busy_heap.busy_push, KernelOnlyDispatcher)
    with pytest.raises(TypeError, match="kernel-only"):
        busy_heap.busy_push(None, None, 0, 0)


def test_a_batch_result_has_every_table_by_name_and_attribute(tmp_path):
    from aisim_fast import Simulation, load_trace, parse_rank, run_batch
    trace = REPO_DIR / "tests" / "data" / "cli" / "mooncake_tiny20.jsonl"
    result = run_batch([Simulation(load_trace(trace), parse_rank({"backend": "vllm"}), workers=2)])
    assert set(result.tables) == set(TABLES)
    for name in TABLES:
        assert result.tables[name] is getattr(result, name)
    assert len(result.requests[0]) == 20
    assert np.array_equal(result.tables["passes"][0]["end_ms"], result.passes[0]["end_ms"])
    assert len(result.kv_events[0]) == 0  # not recorded: an empty table, not an error
