#!/usr/bin/env bash
# CI check for installers/ (called by .ci/run; needs Debian's shellcheck).
#
#  1. shellcheck on every *.sh in the repository and on .ci/run;
#  2. a real Linux install in a throw-away HOME with --no-start (torch from
#     GPUFLEX_TORCH_SPEC, default torch==2.13.0 through pip's own configuration;
#     gpuflex from this checkout), then:
#       - the unit: `systemd-analyze verify --user` when it can run here, otherwise a
#         strict parse by installers/linux/unitcheck.py (the log says which);
#       - the installed `gpuflex-node --version` runs and `gpuflex-node run --help`
#         accepts the flags the unit passes;
#       - a second run upgrades in place (idempotent);
#  3. --uninstall --keep-identity keeps only the identity; --uninstall removes
#     the rest, and the file list of HOME equals the one before the install.
#
# Environment: PYTHON (a python for unitcheck.py; default python3),
# GPUFLEX_TORCH_SPEC / GPUFLEX_TORCH_INDEX (passed to the installer),
# GPUFLEX_CHECK_KEEP=1 keeps the temporary folder for inspection.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
INSTALLER=$ROOT/installers/linux/install.sh
START=$(date +%s)

step() { printf '\n== installers/check.sh: %s (%ss)\n' "$*" "$(($(date +%s) - START))"; }
fail() {
    printf 'installers/check.sh: FAIL: %s\n' "$*" >&2
    exit 1
}

# ----------------------------------------------------------------------------- 1. shellcheck

step "shellcheck"
command -v shellcheck >/dev/null 2>&1 \
    || fail "shellcheck is not installed; run: apt-get install -y shellcheck"
scripts=()
while IFS= read -r f; do
    scripts[${#scripts[@]}]=$f
done < <(cd "$ROOT" && find . \( -name .git -o -name .venv -o -name node_modules -o -name build \
    -o -name dist -o -name .peers \) -prune -o -type f -name '*.sh' -print | sed 's|^\./||' | sort)
[ -f "$ROOT/.ci/run" ] && scripts[${#scripts[@]}]=.ci/run
ours=()
others=()
for f in "${scripts[@]}"; do
    case $f in
        installers/*) ours[${#ours[@]}]=$f ;;
        *) others[${#others[@]}]=$f ;;
    esac
done
# Every finding in installers/; warnings and errors elsewhere.
(cd "$ROOT" && shellcheck -x --severity=style "${ours[@]}") || fail "shellcheck found problems (above)"
if [ "${#others[@]}" -gt 0 ]; then
    (cd "$ROOT" && shellcheck -x --severity=warning "${others[@]}") || fail "shellcheck found problems (above)"
fi
printf 'shellcheck: %s files clean: %s\n' "${#scripts[@]}" "${scripts[*]}"

# ----------------------------------------------------------------------------- 2. install

TMP=$(mktemp -d "${TMPDIR:-/tmp}/gpuflex-check.XXXXXX")
if [ "${GPUFLEX_CHECK_KEEP:-0}" = 1 ]; then
    trap 'echo "kept $TMP"' EXIT
else
    trap 'rm -rf "$TMP"' EXIT
fi

# The pip cache of the caller (not of the throw-away HOME) so repeated runs are fast.
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pip}
# Byte-compiling torch's thousands of modules is most of a fresh install's time.
export PIP_NO_COMPILE=1
export GPUFLEX_TORCH_SPEC=${GPUFLEX_TORCH_SPEC:-torch==2.13.0}
export GPUFLEX_TORCH_INDEX=${GPUFLEX_TORCH_INDEX-}

# Tools keep their own homes: pip asks rustc for its version (user agent), and a
# rustup proxy would otherwise write ~/.rustup into the throw-away HOME.
export RUSTUP_HOME=${RUSTUP_HOME:-$HOME/.rustup} CARGO_HOME=${CARGO_HOME:-$HOME/.cargo}

FAKE_HOME=$TMP/home
mkdir -p "$FAKE_HOME/.config" "$FAKE_HOME/.local/share" "$FAKE_HOME/.local/bin" "$FAKE_HOME/.cache"
mkdir -m 700 "$TMP/run"
export HOME=$FAKE_HOME XDG_RUNTIME_DIR=$TMP/run
unset XDG_DATA_HOME XDG_CONFIG_HOME XDG_CACHE_HOME DBUS_SESSION_BUS_ADDRESS
snapshot() { (cd "$FAKE_HOME" && find . | LC_ALL=C sort); }
snapshot >"$TMP/before.txt"

HUB=http://127.0.0.1:9
KEY=gf1-abcd-efgh-ijkl-mnop-qrst
PREFIX=$FAKE_HOME/.local/share/gpuflex
UNIT=$FAKE_HOME/.config/systemd/user/gpuflex-node.service
ENVFILE=$FAKE_HOME/.config/gpuflex/node.env
NODE=$PREFIX/venv/bin/gpuflex-node

step "install into a temporary HOME (torch: $GPUFLEX_TORCH_SPEC${GPUFLEX_TORCH_INDEX:+ from $GPUFLEX_TORCH_INDEX})"
"$INSTALLER" --hub "$HUB" --hub-key "$KEY" --torch cpu --no-start --source "$ROOT" >"$TMP/install.log" 2>&1 \
    || { tail -n 40 "$TMP/install.log"; fail "install.sh failed (log above)"; }
grep -E '^(==>|  )' "$TMP/install.log" || true

[ -f "$UNIT" ] || fail "no unit at $UNIT"
[ -f "$ENVFILE" ] || fail "no environment file at $ENVFILE"
[ "$(stat -c %a "$ENVFILE")" = 600 ] || fail "$ENVFILE is not mode 600"
[ -x "$NODE" ] || fail "no $NODE"
[ "$(readlink "$FAKE_HOME/.local/bin/gpuflex-node")" = "$NODE" ] || fail "\$HOME/.local/bin/gpuflex-node does not point into the venv"

step "verify the unit"
probe=$TMP/probe.service
printf '[Service]\nExecStart=/bin/true\n[Install]\nWantedBy=default.target\n' >"$probe"
if command -v systemd-analyze >/dev/null 2>&1 && systemd-analyze verify --user "$probe" >/dev/null 2>&1; then
    out=$(systemd-analyze verify --user "$UNIT" 2>&1) || fail "systemd-analyze verify --user: $out"
    [ -z "$out" ] || fail "systemd-analyze verify --user warns: $out"
    echo "systemd-analyze verify --user $UNIT: clean"
else
    echo "systemd-analyze verify --user cannot run here; falling back to the strict parse of installers/linux/unitcheck.py"
fi
"$PYTHON" "$ROOT/installers/linux/unitcheck.py" "$UNIT" --require-exec || fail "unitcheck rejected the unit"
grep -q -- "--hub \"$HUB\" --hub-key \"$KEY\" --data-dir \"$PREFIX/node\"" "$UNIT" \
    || fail "ExecStart does not pass --hub, --hub-key and --data-dir as expected"

step "run the installed gpuflex-node"
version=$("$NODE" --version 2>&1) || fail "gpuflex-node --version failed: $version"
echo "gpuflex-node --version: $version"
help=$("$NODE" run --help 2>&1) || fail "gpuflex-node run --help failed: $help"
for flag in --hub --hub-key --data-dir; do
    printf '%s\n' "$help" | grep -q -- "$flag" || fail "gpuflex-node run --help does not list $flag (the unit passes it)"
done
echo "gpuflex-node run accepts --hub --hub-key --data-dir"

step "re-run: upgrade in place"
sed -i "s/^GPUFLEX_NODE_ARGS=.*/GPUFLEX_NODE_ARGS=\"--threads 1\"/" "$ENVFILE"
"$INSTALLER" --hub "$HUB" --hub-key "$KEY" --torch cpu --no-start --source "$ROOT" >"$TMP/reinstall.log" 2>&1 \
    || { tail -n 40 "$TMP/reinstall.log"; fail "re-running install.sh failed (log above)"; }
grep -q 'upgrading the existing venv' "$TMP/reinstall.log" || fail "the re-run did not reuse the venv"
grep -q '^GPUFLEX_NODE_ARGS="--threads 1"$' "$ENVFILE" || fail "the re-run lost GPUFLEX_NODE_ARGS"
"$NODE" --version >/dev/null 2>&1 || fail "gpuflex-node --version failed after the re-run"
echo "re-run reused the venv and kept GPUFLEX_NODE_ARGS"

# ----------------------------------------------------------------------------- 3. uninstall

step "uninstall --keep-identity"
printf 'fake key\n' >"$PREFIX/node/node.key"
chmod 600 "$PREFIX/node/node.key"
mkdir -p "$PREFIX/node/cache"
printf 'x' >"$PREFIX/node/cache/blob"
"$INSTALLER" --uninstall --keep-identity >"$TMP/uninstall1.log" 2>&1 \
    || { cat "$TMP/uninstall1.log"; fail "install.sh --uninstall --keep-identity failed"; }
left=$(cd "$PREFIX" && find . -mindepth 1 | LC_ALL=C sort | tr '\n' ' ')
[ "$left" = "./.gpuflex-install ./node ./node/node.key " ] \
    || fail "--keep-identity left '$left' (expected the marker and node/node.key)"
if [ -e "$UNIT" ] || [ -e "$ENVFILE" ]; then
    fail "--uninstall left the unit or the environment file"
fi
echo "kept: $left"

step "uninstall"
"$INSTALLER" --uninstall >"$TMP/uninstall2.log" 2>&1 \
    || { cat "$TMP/uninstall2.log"; fail "install.sh --uninstall failed"; }
snapshot >"$TMP/after.txt"
if ! diff -u "$TMP/before.txt" "$TMP/after.txt"; then
    fail "--uninstall left files behind in HOME (diff above)"
fi
echo "HOME is as it was before the install"

step "done: all installer checks passed"
