"""The product's code stays easy to see, read from the source (ast): no class over 25 methods, no
function over 80 lines, no module over 800 lines in hub/, node/ and protocol/. An exception is
named in ``EXCEPTIONS`` with the reason it reads better whole; an exception that no longer
breaks the rule must be removed, so the list cannot go stale."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_METHODS = 25
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 800

#: "path[:name]" -> why it reads better whole
EXCEPTIONS: dict[str, str] = {
}


def _sources(root: Path) -> Iterator[Path]:
    for package in ("hub", "node", "protocol"):
        yield from sorted((root / package).rglob("*.py"))


def breaches(root: Path = ROOT) -> dict[str, str]:
    """Every place over a limit: "path[:name]" -> what it measures."""
    found: dict[str, str] = {}
    for path in _sources(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            found[rel] = f"module of {lines} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                methods = [b for b in node.body if isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef)]
                if len(methods) > MAX_METHODS:
                    found[f"{rel}:{node.name}"] = f"class of {len(methods)} methods"
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found[f"{rel}:{node.name}"] = f"function of {length} lines"
    return found


def test_no_class_function_or_module_over_its_limit_unless_named() -> None:
    over = breaches()
    unnamed = {k: v for k, v in over.items() if k not in EXCEPTIONS}
    assert not unnamed, "over the size limits (split it, or name it in EXCEPTIONS with a reason):\n" + "\n".join(
        f"  {k}: {v}" for k, v in sorted(unnamed.items()))


def test_every_named_exception_still_breaks_a_limit() -> None:
    stale = sorted(set(EXCEPTIONS) - set(breaches()))
    assert not stale, f"no longer over a limit, remove from EXCEPTIONS: {stale}"


def test_the_check_finds_each_kind_of_breach(tmp_path: Path) -> None:
    room = tmp_path / "hub"
    room.mkdir()
    long_fn = "def f():\n" + "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    big_class = "class C:\n" + "".join(f"    def m{i}(self): ...\n" for i in range(MAX_METHODS + 1))
    (room / "one.py").write_text(long_fn + big_class)
    (room / "two.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (room / "three.py").write_text("def g():\n" + "    pass\n" * (MAX_FUNCTION_LINES - 1))
    one, two = (p.relative_to(tmp_path).as_posix() for p in (room / "one.py", room / "two.py"))
    assert breaches(tmp_path) == {f"{one}:f": f"function of {MAX_FUNCTION_LINES + 1} lines",
                                  f"{one}:C": f"class of {MAX_METHODS + 1} methods",
                                  two: f"module of {MAX_MODULE_LINES + 1} lines"}
