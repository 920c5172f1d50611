"""Comments, docstrings and messages name only files that exist in this repository, and no
path outside it (no notes folders, no absolute paths of the machine it was written on)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("hub", "node", "protocol", "tests", "bench", "installers", "docs")
OUTSIDE = re.compile(r"/[w]ork/|\bnotes/|\bshared/|\bCONTRACT\.md\b|\bcli_demo\b")
# a repository file named in text: hub/policy/dataset.py, tests/tooling/attacks.py, docs/x.md, README.md
NAMED = re.compile(r"(?<![\w./-])((?:hub|node|protocol|tests|bench|installers|docs)/[\w./-]*\w\.(?:py|md|sh|ps1|toml|json|html)"
                   r"|[A-Z][A-Z_]+\.md)\b")
THIS = Path(__file__).relative_to(REPO).as_posix()


def _sources() -> list[Path]:
    out = []
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*")):
            # (".peers": the peers' own venvs, which bench/vs_flower.py builds there, git-ignored)
            if path.suffix in (".py", ".sh", ".ps1", ".html", ".md", ".toml") and "artifacts" not in path.parts \
                    and ".peers" not in path.parts:
                out.append(path)
    return out


def _exists(ref: str) -> bool:
    return (REPO / ref).exists() or (REPO / "node" / ref).exists()  # an installer names its own files


def test_no_reference_outside_the_repository_or_to_a_missing_file():
    problems = []
    for path in _sources():
        rel = path.relative_to(REPO).as_posix()
        if rel == THIS:
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            bad = [m.group(0) for m in OUTSIDE.finditer(line)]
            bad += [ref for ref in NAMED.findall(line) if not _exists(ref)]
            if bad:
                problems.append(f"{rel}:{lineno}: {', '.join(bad)}")
    assert not problems, "\n".join(problems)


def test_bench_results_name_no_path_of_the_machine_they_ran_on():
    """A result file is read on other machines: it names no absolute path (a temp folder, a
    home folder) where a reader could follow nothing."""
    absolute = re.compile(r'"(/tmp/|/[h]ome/|/[r]oot/|/[w]ork/|/var/|/Users/|[A-Z]:\\\\)')
    found = [f"{p.name}: {m.group(0)}" for p in sorted((REPO / "bench" / "results").glob("*.json"))
             for m in absolute.finditer(p.read_text(errors="replace"))]
    assert not found, found
