"""The package's layering, read from the code's own imports (no import is executed).

- No import circle (function-local imports count; a package's `__init__` handing out its own
  modules, as `laminar.runtime.open_runtime` does, is not an arrow of the circle).
- No arrow runs up: a module imports only from its own layer or lower ones (function-local
  imports count too: deferring an import does not change who depends on whom).
- Ray at the edges: `import ray` only in laminar/runtime/, the dev cluster, the actor shells
  (`*/actor.py`) and the benchmarks.

Layers, low to high; a package or top-level module not listed is not checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "laminar"
LAYERS = [
    {"types", "config", "plugins", "provenance", "actor", "metrics", "sinks", "models", "sandbox",
     "devices", "live", "report", "report_plots"},
    {"engine"},
    {"relay"},
    {"envs"},
    {"tasks"},
    {"trainer"},
    {"pools"},
    {"rollout"},
    {"manager"},
    {"runtime"},
    {"observe", "devcluster"},
    {"modes"},
    {"doctor"},
    {"sim"},
    {"cli"},
    {"bench"},
]
RAY_ROOMS = ("runtime", "devcluster", "bench")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("laminar", *path.relative_to(ROOT).with_suffix("").parts))
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path) -> list[str]:
    """Every name `path` imports, at module level or in a function; TYPE_CHECKING blocks and the
    `if __name__ == "__main__":` block (a script's entry, run as its own module) aside."""
    found: list[str] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ("TYPE_CHECKING" in ast.unparse(child.test)
                                              or "__main__" in ast.unparse(child.test)):
                continue
            if isinstance(child, ast.Import):
                found.extend(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append(child.module)
                found.extend(f"{child.module}.{a.name}" for a in child.names)
            walk(child)

    walk(ast.parse(path.read_text()))
    return found


def _layer(module: str) -> int | None:
    room = module.split(".")[1] if "." in module else None
    return next((i for i, layer in enumerate(LAYERS) if room in layer), None)


def _arrows() -> dict[str, set[str]]:
    arrows: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for name in _imports(path):
            target = _resolve(name) if name.startswith("laminar") else None
            if target and target != module:
                arrows[module].add(target)
    return arrows


def test_no_import_circles():
    arrows = {a: {b for b in targets if not b.startswith(a + ".")}
              for a, targets in _arrows().items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        for target in sorted(arrows[module]):
            visit(target, path + [module])
        done.add(module)

    for module in sorted(MODULES):
        visit(module, [])


def test_no_arrow_runs_up():
    up = [f"{a} -> {b}" for a, targets in _arrows().items() for b in targets
          if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)]
    assert not up, "imports of a higher layer:\n" + "\n".join(sorted(up))


def test_ray_is_imported_only_at_the_edges():
    where = [module for module, path in MODULES.items()
             if any(name.split(".")[0] == "ray" for name in _imports(path))
             and not (module.split(".")[1] in RAY_ROOMS or path.name == "actor.py")]
    assert not where, f"modules importing ray outside {RAY_ROOMS} and the actor shells: {where}"
