"""Strict parse of the systemd user unit that installers/linux/install.sh writes.

Used by installers/check.sh where ``systemd-analyze verify --user`` cannot run, and by
tests/test_installers.py. It is deliberately narrower than systemd: it knows the keys
the installer writes (and a few neighbours), so a typo or a value systemd would ignore
with only a log line fails here loudly.

    python installers/linux/unitcheck.py UNIT_FILE [--require-exec]
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

_BOOL = {"yes", "no", "true", "false", "on", "off", "1", "0"}
_TIMESPAN = re.compile(r"^(\d+(\.\d+)?\s*(us|ms|s|sec|m|min|h|hr|d)?\s*)+$|^infinity$")


def _one_of(*allowed: str):
    def check(value: str) -> str | None:
        return None if value in allowed else f"must be one of {', '.join(allowed)}"

    return check


def _boolean(value: str) -> str | None:
    return None if value in _BOOL else "must be a boolean (yes/no)"


def _timespan(value: str) -> str | None:
    return None if _TIMESPAN.match(value) else "must be a time span like 30s or 15min"


def _int_range(lo: int, hi: int):
    def check(value: str) -> str | None:
        try:
            number = int(value)
        except ValueError:
            return f"must be an integer in {lo}..{hi}"
        return None if lo <= number <= hi else f"must be an integer in {lo}..{hi}"

    return check


def _positive_int(value: str) -> str | None:
    return None if value.isdigit() and int(value) > 0 else "must be a positive integer"


def _umask(value: str) -> str | None:
    return None if re.fullmatch(r"0?[0-7]{3}", value) else "must be an octal mode like 0077"


def _abs_path(value: str) -> str | None:
    path = value[1:] if value.startswith("-") else value
    return None if path.startswith("/") else "must be an absolute path"


def _paths(value: str) -> str | None:
    try:
        words = shlex.split(value)
    except ValueError as exc:
        return f"bad quoting: {exc}"
    for word in words:
        word = word.lstrip("-+")
        if not word.startswith("/"):
            return f"{word!r} is not an absolute path"
    return None


def _address_families(value: str) -> str | None:
    words = value.lstrip("~").split()
    if not words or not all(re.fullmatch(r"AF_[A-Z0-9]+", w) for w in words):
        return "must be a list of AF_* names"
    return None


def _exec(value: str) -> str | None:
    try:
        argv = shlex.split(value)
    except ValueError as exc:
        return f"bad quoting: {exc}"
    if not argv:
        return "is empty"
    program = argv[0].lstrip("@-:+!")
    return None if program.startswith("/") else "must start with an absolute path"


def _targets(value: str) -> str | None:
    words = value.split()
    if not words or not all(w.endswith((".target", ".service")) for w in words):
        return "must name .target or .service units"
    return None


def _text(value: str) -> str | None:
    return None if value else "is empty"


_KEYS: dict[str, dict[str, object]] = {
    "Unit": {
        "Description": _text,
        "Documentation": _text,
        "After": _targets,
        "Wants": _targets,
        "StartLimitIntervalSec": _timespan,
        "StartLimitBurst": _positive_int,
    },
    "Service": {
        "Type": _one_of("simple", "exec", "notify", "forking", "oneshot", "idle"),
        "EnvironmentFile": _abs_path,
        "Environment": _text,
        "ExecStart": _exec,
        "WorkingDirectory": _abs_path,
        "Restart": _one_of(
            "no", "on-success", "on-failure", "on-abnormal", "on-watchdog", "on-abort", "always"
        ),
        "RestartSec": _timespan,
        "RestartSteps": _positive_int,
        "RestartMaxDelaySec": _timespan,
        "TimeoutStopSec": _timespan,
        "Nice": _int_range(-20, 19),
        "CPUSchedulingPolicy": _one_of("other", "batch", "idle", "fifo", "rr"),
        "IOSchedulingClass": _one_of("realtime", "best-effort", "idle", "none", "1", "2", "3"),
        "OOMScoreAdjust": _int_range(-1000, 1000),
        "NoNewPrivileges": _boolean,
        "UMask": _umask,
        "LockPersonality": _boolean,
        "RestrictRealtime": _boolean,
        "RestrictSUIDSGID": _boolean,
        "SystemCallArchitectures": _one_of("native"),
        "RestrictAddressFamilies": _address_families,
        "PrivateTmp": _boolean,
        "ProtectSystem": _one_of("yes", "no", "true", "false", "full", "strict"),
        "ProtectHome": _one_of("yes", "no", "true", "false", "read-only", "tmpfs"),
        "ReadWritePaths": _paths,
    },
    "Install": {"WantedBy": _targets},
}

_REQUIRED = {("Service", "ExecStart"), ("Service", "Restart"), ("Install", "WantedBy")}


def parse_unit(text: str) -> dict[str, dict[str, str]]:
    """Return {section: {key: value}} or raise ValueError naming every problem."""
    problems: list[str] = []
    sections: dict[str, dict[str, str]] = {}
    current: str | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if raw.rstrip().endswith("\\"):
            problems.append(f"line {number}: continuation lines are not expected")
            continue
        header = re.fullmatch(r"\[([A-Za-z]+)\]", line)
        if header:
            current = header.group(1)
            if current not in _KEYS:
                problems.append(f"line {number}: unknown section [{current}]")
            elif current in sections:
                problems.append(f"line {number}: section [{current}] appears twice")
            sections.setdefault(current, {})
            continue
        if "=" not in line:
            problems.append(f"line {number}: not 'Key=value': {line!r}")
            continue
        if current is None:
            problems.append(f"line {number}: key outside any section")
            continue
        key, value = (part.strip() for part in line.split("=", 1))
        known = _KEYS.get(current, {})
        if key not in known:
            problems.append(f"line {number}: unknown key {key!r} in [{current}]")
            continue
        if key in sections[current]:
            problems.append(f"line {number}: {key} set twice in [{current}]")
            continue
        check = known[key]
        error = check(value)  # type: ignore[operator]
        if error:
            problems.append(f"line {number}: {current}.{key}={value!r} {error}")
        sections[current][key] = value
    for section, key in sorted(_REQUIRED):
        if key not in sections.get(section, {}):
            problems.append(f"missing {section}.{key}")
    if problems:
        raise ValueError("; ".join(problems))
    return sections


def exec_argv(sections: dict[str, dict[str, str]]) -> list[str]:
    """The ExecStart command line split into words, as systemd would (quotes removed)."""
    return shlex.split(sections["Service"]["ExecStart"])


def main(argv: list[str]) -> int:
    if not argv or argv[0] in {"-h", "--help"}:
        print(__doc__.strip())
        return 2
    path = Path(argv[0])
    try:
        sections = parse_unit(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"unitcheck: {path}: {exc}", file=sys.stderr)
        return 1
    if "--require-exec" in argv[1:]:
        program = Path(exec_argv(sections)[0].lstrip("@-:+!"))
        if not (program.is_file() and program.stat().st_mode & 0o111):
            print(
                f"unitcheck: {path}: ExecStart program {program} is not executable", file=sys.stderr
            )
            return 1
    print(f"unitcheck: {path}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
