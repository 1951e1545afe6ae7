"""The code's shape: stages are rooms over a shared floor, and every function fits on a screen."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("tokenize", "preflight", "train", "validate", "evaluate")
MAX_FUNCTION_LINES = 80


def _sources(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """Every module an import statement names, lazy imports inside functions included."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            if node.module == "components":  # `from components import train`
                found += [(node.lineno, f"components.{a.name}") for a in node.names]
    return found


def test_no_stage_imports_another_stage():
    sideways = []
    for path in _sources("components"):
        rel = path.relative_to(ROOT / "components")
        own = rel.parts[0] if len(rel.parts) > 1 else None
        for line, module in _imported_modules(ast.parse(path.read_text())):
            parts = module.split(".")
            if parts[0] == "components" and len(parts) > 1 and parts[1] in STAGES and parts[1] != own:
                sideways.append(f"components/{rel}:{line} imports {module}")
    assert not sideways, "stages import the shared floor, never each other:\n" + "\n".join(sideways)


def test_the_floor_imports_no_stage():
    """components/*.py (the floor) stands under the stages, never on them."""
    upward = [
        f"{path.name}:{line} imports {module}"
        for path in sorted((ROOT / "components").glob("*.py"))
        for line, module in _imported_modules(ast.parse(path.read_text()))
        if module.split(".")[:2][-1] in STAGES and module.startswith("components.")
    ]
    assert not upward, "\n".join(upward)


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in _sources("components", "pipelines"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} has {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def _readme_layout() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Layout", 1)[1]
    return section.split("```", 2)[1]


def test_readme_layout_matches_the_tree():
    """Every entry the README's layout names exists, and every module on the floor, every
    stage folder, every stage module and every pipelines module is named there."""
    layout = _readme_layout()
    entries, parent = [], None
    for line in layout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name or not (name.endswith("/") or name.endswith(".py")):
            continue
        if not line.startswith(" "):
            parent = name
            entries.append(name)
        else:
            entries.append(parent + name)
    missing = [e for e in entries if not (ROOT / e).exists()]
    assert not missing, f"README layout names what is not there: {missing}"
    expected = [f"components/{p.name}" for p in (ROOT / "components").glob("*.py") if p.name != "__init__.py"]
    expected += [f"pipelines/{p.name}" for p in (ROOT / "pipelines").glob("*.py") if p.name != "__init__.py"]
    expected += [f"components/{d.name}/" for d in (ROOT / "components").iterdir() if (d / "__init__.py").exists()]
    unnamed = [e for e in expected if e not in entries]
    assert not unnamed, f"README layout does not name: {unnamed}"
    for stage in STAGES:  # a stage's line (and its continuation lines) names each of its modules
        block = layout.split(f"  {stage}/", 1)[1].split("\n  ", 1)[0]
        block += "".join(ln for ln in layout.split(f"  {stage}/", 1)[1].splitlines()[1:] if ln.startswith(" " * 10))
        modules = {p.stem for p in (ROOT / "components" / stage).glob("*.py") if p.name != "__init__.py"}
        unnamed = [m for m in modules if m not in block]
        assert not unnamed, f"README layout's {stage}/ line does not name {unnamed}"
