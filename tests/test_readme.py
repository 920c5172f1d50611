"""The README is a short entry point and docs/ holds the reference: the README stays within
400 lines and links every docs page, every relative link in the README and in docs/ leads to
a file (and heading) that exists, every gpuflex-hub / gpuflex-node command shown is one the CLI
takes, and the job-spec reference and model examples in docs/job-spec.md, like the README's own
spec, are real, parseable specs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from gpuflex.protocol import jobspec
from gpuflex.protocol.modelspec import build_model, param_count

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
JOB_SPEC = DOCS / "job-spec.md"
BLOCKS = re.findall(r"```toml\n(.*?)```", JOB_SPEC.read_text(), flags=re.S)
MODEL_BLOCKS = [b for b in BLOCKS if b.lstrip().startswith("#") and "[model]" in b]
REFERENCE = next(b for b in BLOCKS if "[verification]" in b)
MAX_README_LINES = 400


def test_readme_has_examples_for_every_model_kind() -> None:
    kinds = {re.search(r'kind = "(\w+)"', b).group(1) for b in MODEL_BLOCKS}  # type: ignore[union-attr]
    assert kinds == {"mlp", "cnn", "sequential", "transformer"}


@pytest.mark.parametrize("block", MODEL_BLOCKS, ids=lambda b: re.search(r'kind = "(\w+)"', b).group(1))  # type: ignore[union-attr]
def test_reference_with_each_model_example_parses_and_builds(block: str) -> None:
    reference = REFERENCE.replace("[model]                         # required: one of the four kinds below\n", "")
    spec = jobspec.parse_job_spec(reference + "\n" + block)
    assert spec.name == "digits"
    model = build_model(spec.model, seed=0)
    assert sum(p.numel() for p in model.parameters()) == param_count(spec.model)


def test_reference_defaults_match_the_parser() -> None:
    """Every value the reference shows is the parser's default (the reference is not a wish list)."""
    reference = REFERENCE.replace("[model]                         # required: one of the four kinds below\n", "")
    mlp = next(b for b in MODEL_BLOCKS if 'kind = "mlp"' in b)
    shown = jobspec.parse_job_spec(reference + "\n" + mlp)
    minimal = jobspec.parse_job_spec('[job]\nname = "digits"\n' + mlp)
    assert shown == minimal


def test_the_owners_spec_in_the_readme_parses_and_builds() -> None:
    blocks = re.findall(r"```toml\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the owner's journey shows a spec.toml"
    for block in blocks:
        spec = jobspec.parse_job_spec(block)
        build_model(spec.model, seed=0)


def test_readme_is_at_most_400_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move reference material into docs/"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {_target(README, link)[0] for link in _links(README)}
    pages = sorted(DOCS.glob("*.md"))
    assert pages
    missing = [p.relative_to(REPO).as_posix() for p in pages if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def _links(path: Path) -> list[str]:
    """The targets of the markdown links in a file, outside code blocks and code spans."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def _target(page: Path, link: str) -> tuple[Path, str]:
    file, _, anchor = link.partition("#")
    return ((page.parent / file).resolve() if file else page.resolve()), anchor


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    fence = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", "")).replace(" ", "-")
            out.add(slug)
    return out


def test_every_relative_link_in_the_readme_and_docs_leads_somewhere() -> None:
    problems = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for link in _links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto: ...
                continue
            assert not link.startswith("/"), f"{page.name}: {link} is an absolute path"
            target, anchor = _target(page, link)
            if not target.exists():
                problems.append(f"{page.relative_to(REPO)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                problems.append(f"{page.relative_to(REPO)}: {link} (no such heading)")
    assert not problems, "\n".join(problems)


def _cli_commands() -> list[tuple[str, str]]:
    """(page, command) for every gpuflex-hub / gpuflex-node command in a shell block of the README
    or docs/, comments dropped, `a ; b` split."""
    out = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for block in re.findall(r"```sh\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.splitlines():
                for cmd in re.sub(r"\s+#.*$", "", line).split(" ; "):
                    if cmd.strip().split(" ", 1)[0] in ("gpuflex-hub", "gpuflex-node"):
                        out.append((page.relative_to(REPO).as_posix(), cmd.strip()))
    return out


def _argv(cmd: str) -> list[str]:
    """The command as a shell would pass it, with `[optional]` parts given and `a|b` taking a."""
    cmd = re.sub(r"\[([^\]]*)\]", r"\1", cmd)
    cmd = re.sub(r"(\S+?)\|\S+", r"\1", cmd)
    return shlex.split(cmd)


@pytest.mark.parametrize(("page", "cmd"), _cli_commands(), ids=lambda v: v)
def test_every_command_in_the_readme_and_docs_is_one_the_cli_takes(page: str, cmd: str) -> None:
    from gpuflex.hub.ops.cli import build_parser as hub_parser
    from gpuflex.node.cli import build_parser as node_parser

    argv = _argv(cmd)
    parser = {"gpuflex-hub": hub_parser, "gpuflex-node": node_parser}[argv[0]]()
    try:
        parser.parse_args(argv[1:])
    except SystemExit as exc:  # argparse refuses it
        pytest.fail(f"{page}: `{cmd}` is refused by {argv[0]} ({exc})")


def test_the_readme_shows_a_command_for_every_journey() -> None:
    pages = {page for page, _ in _cli_commands()}
    cmds = [cmd for page, cmd in _cli_commands() if page == "README.md"]
    assert "README.md" in pages
    for start in ("gpuflex-node status", "gpuflex-hub job submit", "gpuflex-hub audit verdict", "gpuflex-hub serve"):
        assert any(c.startswith(start) for c in cmds), start
