"""The package's layering: every module imports in a fresh interpreter, and no two modules import each other
(directly or round a loop) at run time."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megadlms"


def _modules() -> dict[str, Path]:
    mods = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted(m for m in _modules() if not m.endswith("__main__"))
    # one fresh interpreter, leaves before their packages' siblings (an interpreter per module would take minutes)
    script = ("import importlib, sys\n"
              "for name in sys.argv[1:]:\n"
              "    importlib.import_module(name)\n")
    done = subprocess.run([sys.executable, "-c", script, *names[::-1]], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def _runtime_imports(tree: ast.Module):
    """Import statements outside `if TYPE_CHECKING:` blocks (those never run)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            node.body = []
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_no_import_cycles():
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = mod.split(".")
                if node.level:
                    base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != mod and not mod.startswith(t + "."):  # a module may import its own package
                    edges[mod].add(t)
    # a cycle exists iff some module reaches itself
    for start in mods:
        seen, stack = set(), list(edges[start])
        while stack:
            m = stack.pop()
            assert m != start, f"import cycle through {start}"
            if m not in seen:
                seen.add(m)
                stack.extend(edges[m])
