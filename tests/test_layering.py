"""The layering holds, read from the source (ast): hub and node import only protocol, never each
other; protocol imports neither and no I/O framework. Inside the hub, the rooms (sub-packages) are
stacked in one declared order and each imports only the rooms below it and itself; no hub module
reaches itself through its imports, counting imports inside functions; the domain knows no HTTP and
no SQL, and only the store writes the domain's tables."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"hub": "gpuflex.hub", "node": "gpuflex.node", "protocol": "gpuflex.protocol"}

#: the hub's rooms, bottom first: each may import only the rooms before it in this list (and itself).
#: base: errors, config, numbers; policy: pure decisions (verification, aggregation, privacy, the
#: round policy, data checks); model: the plain state types (JobState, NodeState...); storage: the
#: store contract and its SQLite/PostgreSQL stores, blobs, the audit log, tokens; domain: the ledger
#: and its use cases, the scheduler, the rounds; server: the HTTP app, its routes, the wire, the workers, the
#: console; ops: the CLI, the demo, the local cluster, the owner's client.
HUB_ROOMS = ("base", "policy", "model", "storage", "domain", "server", "ops")
#: modules at the hub's top level: entry points only
HUB_TOP_LEVEL = {"__init__.py", "__main__.py"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    parts[0] = PACKAGES[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST, *, type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement anywhere in the tree (module level, functions, classes, branches);
    without ``type_checking``, not those under ``if TYPE_CHECKING:`` (they never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        if isinstance(node, ast.If) and not type_checking and _is_type_checking(node):
            for child in node.orelse:
                yield from _import_nodes(ast.Module(body=[child], type_ignores=[]), type_checking=type_checking)
            continue
        yield from _import_nodes(node, type_checking=type_checking)


def _imports_of_source(source: str, here: str, *, is_package: bool, type_checking: bool = True) -> set[str]:
    """Absolute names of everything the module ``here`` imports (relative imports resolved): each
    module named, and each ``module.name`` a from-import takes."""
    tree = ast.parse(source)
    package = here if is_package else here.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in _import_nodes(tree, type_checking=type_checking):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
            continue
        if node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        out.add(mod)
        out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def _imports(path: Path, *, type_checking: bool = True) -> set[str]:
    """Absolute names of everything `path` imports (relative imports resolved)."""
    return _imports_of_source(path.read_text(encoding="utf-8"), _module_name(path),
                              is_package=path.name == "__init__.py", type_checking=type_checking)


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
    fake = ROOT / "hub" / "server" / "console" / "__init__.py"
    names = _imports(fake)
    assert any(n.startswith("gpuflex.hub") for n in names)


# -- the hub's rooms -------------------------------------------------------------------------------


def _hub_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in _sources("hub")}


def _targets(names: set[str], modules: Mapping[str, object]) -> set[str]:
    """The hub modules a set of imported names reaches: a name that is a module, else the nearest
    module that contains it (``gpuflex.hub.model.job.JobState`` -> ``gpuflex.hub.model.job``)."""
    out: set[str] = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name.startswith("gpuflex.hub"):
            out.add(name)
    return out


def _graph(*, type_checking: bool) -> dict[str, set[str]]:
    """Hub module -> the hub modules it imports (anywhere in its file). A from-import of a module
    out of a package (``from ..policy import round_policy``) counts the module, not the package."""
    modules = _hub_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        names = _imports(path, type_checking=type_checking)
        # drop a package when a module under it is what was named
        edges = _targets(names, modules)
        edges = {e for e in edges if not any(o.startswith(e + ".") and o in names for o in edges)}
        graph[name] = edges - {name}
    return graph


def room_violations(graph: Mapping[str, set[str]], rooms: tuple[str, ...] = HUB_ROOMS) -> list[str]:
    """Each import from a room to a room above it (or to a top-level hub module)."""
    rank = {r: i for i, r in enumerate(rooms)}
    bad = []
    for src, targets in sorted(graph.items()):
        parts = src.split(".")
        if len(parts) < 4 or parts[2] not in rank:  # a top-level entry point imports what it runs
            continue
        for dst in sorted(targets):
            dparts = dst.split(".")
            if len(dparts) < 4 or dparts[2] not in rank:
                if dst != "gpuflex.hub":
                    bad.append(f"{src} ({parts[2]}) imports {dst} (the hub's top level)")
                continue
            if rank[dparts[2]] > rank[parts[2]]:
                bad.append(f"{src} ({parts[2]}) imports {dst} ({dparts[2]}, a room above it)")
    return bad


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One import cycle (a list of modules, the first repeated at the end), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    for start in sorted(graph):
        if colour[start] != WHITE:
            continue
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        colour[start] = GREY
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = BLACK
                stack.pop()
            elif colour.get(nxt, BLACK) == GREY:
                path = [n for n, _ in stack]
                return [*path[path.index(nxt):], nxt]
            elif colour.get(nxt) == WHITE:
                colour[nxt] = GREY
                stack.append((nxt, iter(sorted(graph[nxt]))))
    return None


def test_the_hub_is_rooms_with_only_entry_points_at_its_top() -> None:
    hub = ROOT / "hub"
    top = {p.name for p in hub.glob("*.py")}
    assert top <= HUB_TOP_LEVEL, f"hub/ top level holds {sorted(top - HUB_TOP_LEVEL)}: put them in a room"
    rooms = {p.name for p in hub.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(HUB_ROOMS), f"declare each room in HUB_ROOMS, in its place: {sorted(rooms ^ set(HUB_ROOMS))}"


def test_each_room_imports_only_the_rooms_below_it() -> None:
    """Counting imports inside functions and type-only imports: a room may not even name a type
    from a room above it."""
    bad = room_violations(_graph(type_checking=True))
    assert not bad, "a room imports only the rooms below it (HUB_ROOMS):\n" + "\n".join(bad)


def test_no_import_cycle_between_hub_modules() -> None:
    """Counting imports inside functions (a function-level import hides a cycle, it does not remove
    it); not those under ``if TYPE_CHECKING:``, which never run."""
    cycle = find_cycle(_graph(type_checking=False))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_room_and_cycle_checkers_see_violations() -> None:
    """The two tests above can fail: an import from a room below to a room above, and a cycle
    made by an import inside a function, are both found."""
    low = _imports_of_source("def f():\n    from ..server.app import create_app\n",
                             "gpuflex.hub.storage.tokens", is_package=False)
    modules = {"gpuflex.hub.storage.tokens": None, "gpuflex.hub.server.app": None}
    graph = {"gpuflex.hub.storage.tokens": _targets(low, modules), "gpuflex.hub.server.app": {"gpuflex.hub.storage.tokens"}}
    assert graph["gpuflex.hub.storage.tokens"] == {"gpuflex.hub.server.app"}
    assert room_violations(graph) == [
        "gpuflex.hub.storage.tokens (storage) imports gpuflex.hub.server.app (server, a room above it)"]
    assert find_cycle(graph) == ["gpuflex.hub.server.app", "gpuflex.hub.storage.tokens", "gpuflex.hub.server.app"]
    hidden = _imports_of_source("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
                                "gpuflex.hub.storage.b", is_package=False, type_checking=False)
    assert "gpuflex.hub.storage.a" not in hidden
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


# -- the domain and the store ----------------------------------------------------------------------

#: the domain and what it stands on: no HTTP and no SQL (the store contract is an interface)
DOMAIN = [*sorted(str(p.relative_to(ROOT)) for room in ("base", "policy", "model", "domain")
                  for p in (ROOT / "hub" / room).glob("*.py")), "hub/storage/store.py"]


@pytest.mark.parametrize("name", DOMAIN)
def test_the_domain_knows_no_http_and_no_sql(name: str) -> None:
    names = _imports(ROOT / name)
    bad = sorted(n for n in names if n.split(".")[0] in ("aiohttp", "sqlite3", "psycopg")
                 or n.startswith(("gpuflex.hub.server", "gpuflex.hub.ops", "gpuflex.hub.storage.db",
                                  "gpuflex.hub.storage.store_sqlite", "gpuflex.hub.storage.store_postgres",
                                  "gpuflex.hub.storage.backend")))
    assert not bad, f"{name} imports {bad}"


SQL_WRITE = re.compile(r"\b(INSERT (OR \w+ )?INTO|UPDATE \w+ SET|DELETE FROM|REPLACE INTO|COPY \{?\w+\}? .*FROM STDIN)\b")
#: who may write SQL: the domain's stores (SQLite; PostgreSQL: its schema), the two auth tables' own
#: modules, the one-off move of a stopped hub's tables from SQLite to PostgreSQL (hub/storage/migrate.py),
#: and the blob store's pack of small blobs, a file of its own (hub/storage/blobpack.py); the store's
#: rollback aggregate is a module of its own (hub/storage/store_rollback.py)
WRITERS = {"hub/storage/store_sqlite.py", "hub/storage/store_rollback.py", "hub/storage/store_pipelines.py",
           "hub/storage/store_postgres.py",
           "hub/storage/tokens.py",
           "hub/storage/token_admin.py", "hub/server/console/sessions.py", "hub/storage/migrate.py",
           "hub/storage/blobpack.py"}


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
