"""The layering holds, read from the source (ast): hub and node import only protocol, never each
other; protocol imports neither and no I/O framework; inside the hub, the domain (ledger, rounds,
policy) knows no HTTP and no SQL, and only the store writes the domain's tables."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"hub": "gpuflex.hub", "node": "gpuflex.node", "protocol": "gpuflex.protocol"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    parts[0] = PACKAGES[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of everything `path` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def _sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize(("folder", "forbidden"), [
    ("hub", ("gpuflex.node",)),
    ("node", ("gpuflex.hub",)),
    ("protocol", ("gpuflex.hub", "gpuflex.node", "aiohttp", "socket", "sqlite3")),
])
def test_packages_import_only_what_the_layering_allows(folder: str, forbidden: tuple[str, ...]) -> None:
    bad = [
        f"{p.relative_to(ROOT)} imports {name}"
        for p in _sources(folder)
        for name in sorted(_imports(p))
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The test above can fail: a relative import that climbs out of the package is resolved."""
    fake = ROOT / "hub" / "web" / "__init__.py"
    names = _imports(fake)
    assert any(n.startswith("gpuflex.hub") for n in names)


DOMAIN = ["ledger.py", "rounds.py", "policy.py", "scheduler.py", "verification.py", "aggregation.py", "jobs.py", "store.py",
          "evaluation.py"]


@pytest.mark.parametrize("name", DOMAIN)
def test_the_domain_knows_no_http_and_no_sql(name: str) -> None:
    names = _imports(ROOT / "hub" / name)
    bad = sorted(n for n in names if n.split(".")[0] in ("aiohttp", "sqlite3")
                 or n.startswith(("gpuflex.hub.routes_", "gpuflex.hub.web", "gpuflex.hub.db",
                                  "gpuflex.hub.store_sqlite", "gpuflex.hub.app")))
    assert not bad, f"hub/{name} imports {bad}"


SQL_WRITE = re.compile(r"\b(INSERT (OR \w+ )?INTO|UPDATE \w+ SET|DELETE FROM|REPLACE INTO|COPY \{?\w+\}? .*FROM STDIN)\b")
#: who may write SQL: the domain's stores (SQLite; PostgreSQL: its schema), the two auth tables' own
#: modules, the one-off move of a stopped hub's tables from SQLite to PostgreSQL (hub/migrate.py), and
#: the blob store's pack of small blobs, a file of its own (hub/blobpack.py)
WRITERS = {"hub/store_sqlite.py", "hub/store_postgres.py", "hub/tokens.py", "hub/web/sessions.py", "hub/migrate.py",
           "hub/blobpack.py"}


def test_the_sql_pattern_matches_writes_and_not_prose() -> None:
    assert SQL_WRITE.search("INSERT OR REPLACE INTO models (job_id) VALUES (?)")
    assert SQL_WRITE.search("UPDATE jobs SET state = ?")
    assert not SQL_WRITE.search("update bytes do not hash to update_sha256")
    assert SQL_WRITE.search("COPY {t} ({col_list}) FROM STDIN")


def test_only_the_store_writes_the_domains_tables() -> None:
    bad = []
    for path in _sources("hub"):
        rel = str(path.relative_to(ROOT))
        if rel in WRITERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL_WRITE.search(node.value):
                bad.append(f"{rel}:{node.lineno}: {node.value[:60]!r}")
    assert not bad, "state changes belong in the ledger and its store:\n" + "\n".join(bad)
