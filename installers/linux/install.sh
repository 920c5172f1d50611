#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# GPUFlex node installer for Linux: a venv in the user's data folder and a
# systemd *user* unit that runs `gpuflex-node run` in the background at low
# priority. No root needed. Re-running upgrades in place; --uninstall removes
# everything it made. See installers/README.md.
set -euo pipefail

GF_PROG=$(basename "$0")
GF_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../lib/common.sh
. "$GF_HERE/../lib/common.sh"

GF_UNIT_NAME=gpuflex-node.service

gf_usage() {
    cat <<EOF
usage: $GF_PROG --hub URL [--hub-key FPR] [--prefix DIR] [--torch cpu|cuda|auto]
                [--source PATH_OR_SPEC] [--sandbox auto|on|off] [--no-start] [--dry-run]
       $GF_PROG --uninstall [--keep-identity] [--prefix DIR] [--dry-run]

Installs the GPUFlex volunteer node for this user: a venv in
\${XDG_DATA_HOME:-~/.local/share}/gpuflex (or --prefix) and the systemd user unit
~/.config/systemd/user/$GF_UNIT_NAME, then enables and starts it.

  --hub URL           hub to train for (required to install)
  --hub-key FPR       pin the hub's key fingerprint (gf1-...); without it the node
                      trusts the key it sees first
  --prefix DIR        install folder (default: \${XDG_DATA_HOME:-~/.local/share}/gpuflex)
  --torch KIND        cpu, cuda, or auto (default: cuda when nvidia-smi sees a GPU)
  --source SRC        where gpuflex comes from: a source folder or a pip requirement
                      (default: the repository this script is in)
  --sandbox MODE      namespace hardening in the unit (PrivateTmp, ProtectSystem,
                      ProtectHome); auto = on when unprivileged user namespaces work
  --no-start          install, but do not enable or start the unit
  --dry-run           print every action, change nothing
  --uninstall         stop and remove the node, its venv, unit and settings
  --keep-identity     with --uninstall: keep node.key and hub.pin
  --print-service     print the unit this would install and exit

Environment: GPUFLEX_TORCH_SPEC (pip requirement for torch, default "torch"),
GPUFLEX_TORCH_INDEX (pip index for torch; empty = pip's own configuration;
default for cpu: https://download.pytorch.org/whl/cpu), GPUFLEX_PYTHON.
EOF
}

# ----------------------------------------------------------------------------- paths

gf_linux_paths() {
    local data_home=${XDG_DATA_HOME:-} config_home=${XDG_CONFIG_HOME:-}
    [ -n "${HOME:-}" ] || gf_die "HOME is not set"
    case $data_home in /*) ;; *) data_home=$HOME/.local/share ;; esac
    case $config_home in /*) ;; *) config_home=$HOME/.config ;; esac
    GF_CONFIG_HOME=$config_home
    GF_UNIT_DIR=$config_home/systemd/user
    GF_UNIT_FILE=$GF_UNIT_DIR/$GF_UNIT_NAME
    GF_ENV_DIR=$config_home/gpuflex
    GF_ENV_FILE=$GF_ENV_DIR/node.env
    GF_BIN_LINK=$HOME/.local/bin/gpuflex-node
    if [ -z "$GF_PREFIX" ] && [ "$GF_UNINSTALL" = 1 ] && [ -f "$GF_ENV_FILE" ]; then
        GF_PREFIX=$(sed -n 's/^GPUFLEX_PREFIX="\(.*\)"$/\1/p' "$GF_ENV_FILE" | head -n 1)
    fi
    [ -n "$GF_PREFIX" ] || GF_PREFIX=$data_home/gpuflex
    GF_VENV=$GF_PREFIX/venv
    GF_NODE_DIR=$GF_PREFIX/node
    gf_check_path_chars "install folder" "$GF_PREFIX"
    gf_check_path_chars "config folder" "$config_home"
}

# ----------------------------------------------------------------------------- unit

gf_systemd_version() { # major version of systemctl, 0 when unknown
    local v=${GPUFLEX_SYSTEMD_VERSION:-}
    if [ -z "$v" ] && command -v systemctl >/dev/null 2>&1; then
        v=$(systemctl --version 2>/dev/null | sed -n '1s/^systemd \([0-9][0-9]*\).*/\1/p')
    fi
    case $v in '' | *[!0-9]*) v=0 ;; esac
    echo "$v"
}

gf_userns_works() { # the unit's namespace options need unprivileged user namespaces
    command -v unshare >/dev/null 2>&1 && unshare --user --map-root-user --mount true >/dev/null 2>&1
}

gf_resolve_sandbox() { # prints on|off
    case $GF_SANDBOX in
        on | off) echo "$GF_SANDBOX" ;;
        *) if gf_userns_works; then echo on; else echo off; fi ;;
    esac
}

# gf_render_unit VENV NODE_DIR ENV_FILE HUB HUB_KEY SANDBOX(on|off) SYSTEMD_MAJOR
# Prints the systemd user unit. Every value was validated to hold no quote,
# backslash, '$' or '%', so double quotes are all the escaping it needs.
gf_render_unit() {
    local venv=$1 node_dir=$2 env_file=$3 hub=$4 hub_key=$5 sandbox=$6 sdv=$7
    local key_args="" restart
    [ -z "$hub_key" ] || key_args=" --hub-key \"$hub_key\""
    if [ "$sdv" -ge 254 ]; then
        restart='RestartSec=10s
RestartSteps=8
RestartMaxDelaySec=15min'
    else
        restart='RestartSec=30s'
    fi
    cat <<EOF
# GPUFlex volunteer node, written by installers/linux/install.sh.
# Re-run the installer to change it; "install.sh --uninstall" removes it.
[Unit]
Description=GPUFlex volunteer training node (hub $hub)
# Never stop restarting: the node rides out network loss and hub restarts.
StartLimitIntervalSec=0

[Service]
Type=simple
EnvironmentFile=$env_file
ExecStart="$venv/bin/gpuflex-node" run --hub "$hub"$key_args --data-dir "$node_dir" \$GPUFLEX_NODE_ARGS
Restart=on-failure
$restart
TimeoutStopSec=60s

# Yield to everything the person at the keyboard runs.
Nice=19
CPUSchedulingPolicy=batch
IOSchedulingClass=idle
OOMScoreAdjust=500

# Hardening that a user unit can apply without privileges.
NoNewPrivileges=yes
UMask=0077
LockPersonality=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
SystemCallArchitectures=native
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
EOF
    if [ "$sandbox" = on ]; then
        cat <<EOF
# Needs unprivileged user namespaces (install.sh --sandbox off leaves these out).
PrivateTmp=yes
ProtectSystem=strict
ProtectHome=read-only
ReadWritePaths="$node_dir"
EOF
    fi
    cat <<EOF

[Install]
WantedBy=default.target
EOF
}

# gf_render_env NODE_DIR PREFIX NODE_ARGS_LINE
gf_render_env() {
    local node_dir=$1 prefix=$2 args_line=$3
    cat <<EOF
# Environment of $GF_UNIT_NAME, written by installers/linux/install.sh.
# Extra flags for "gpuflex-node run" go in GPUFLEX_NODE_ARGS (kept when the installer
# re-runs), e.g. GPUFLEX_NODE_ARGS="--threads 2"; then: systemctl --user restart gpuflex-node
$args_line
# Where this install lives (install.sh --uninstall reads it).
GPUFLEX_PREFIX="$prefix"
PYTHONUNBUFFERED=1
PYTHONDONTWRITEBYTECODE=1
# Caches that would otherwise go to ~/.cache, ~/.nv or ~/.triton (read-only under the sandbox).
XDG_CACHE_HOME="$node_dir/sys-cache"
CUDA_CACHE_PATH="$node_dir/sys-cache/nv"
TRITON_CACHE_DIR="$node_dir/sys-cache/triton"
EOF
}

gf_existing_args_line() { # keep the user's GPUFLEX_NODE_ARGS across re-runs
    local line=""
    if [ -f "$GF_ENV_FILE" ]; then
        line=$(grep -m 1 '^GPUFLEX_NODE_ARGS=' "$GF_ENV_FILE" || true)
    fi
    printf '%s' "${line:-GPUFLEX_NODE_ARGS=}"
}

# ----------------------------------------------------------------------------- systemctl

gf_user_manager_up() {
    command -v systemctl >/dev/null 2>&1 && systemctl --user show-environment >/dev/null 2>&1
}

gf_write_service_files() { # gf_write_service_files SANDBOX
    local sandbox=$1 sdv
    sdv=$(gf_systemd_version)
    gf_mkdir 700 "$GF_ENV_DIR"
    gf_write_file "$GF_ENV_FILE" 600 "$(gf_render_env "$GF_NODE_DIR" "$GF_PREFIX" "$(gf_existing_args_line)")"
    gf_mkdir 755 "$GF_UNIT_DIR"
    gf_write_file "$GF_UNIT_FILE" 644 "$(gf_render_unit "$GF_VENV" "$GF_NODE_DIR" "$GF_ENV_FILE" "$GF_HUB" "$GF_HUB_KEY" "$sandbox" "$sdv")"
    if [ "$GF_DRY_RUN" = 0 ] && command -v systemd-analyze >/dev/null 2>&1 && [ -n "${XDG_RUNTIME_DIR:-}" ]; then
        systemd-analyze verify --user "$GF_UNIT_FILE" >/dev/null 2>&1 \
            || gf_warn "systemd-analyze verify --user $GF_UNIT_FILE reported problems"
    fi
}

gf_start_unit() { # enable + (re)start; falls back to --sandbox off when namespaces fail
    local sandbox=$1 status
    gf_run systemctl --user daemon-reload || gf_die "systemctl --user daemon-reload failed"
    gf_run systemctl --user enable "$GF_UNIT_NAME" || gf_die "systemctl --user enable $GF_UNIT_NAME failed"
    gf_run systemctl --user restart "$GF_UNIT_NAME" || gf_die "systemctl --user restart $GF_UNIT_NAME failed; see: journalctl --user -u gpuflex-node"
    [ "$GF_DRY_RUN" = 0 ] || return 0
    sleep 3
    status=$(systemctl --user show -p ExecMainStatus --value "$GF_UNIT_NAME" 2>/dev/null || echo 0)
    if [ "$status" = 226 ]; then # 226/NAMESPACE: the sandbox could not be set up here
        if [ "$GF_SANDBOX" = auto ] && [ "$sandbox" = on ]; then
            gf_warn "the unit's namespace sandbox does not work on this system (status 226/NAMESPACE); reinstalling the unit without it"
            gf_write_service_files off
            gf_run systemctl --user daemon-reload
            gf_run systemctl --user restart "$GF_UNIT_NAME"
        else
            gf_die "$GF_UNIT_NAME failed with 226/NAMESPACE; re-run with --sandbox off"
        fi
    fi
}

# ----------------------------------------------------------------------------- install / uninstall

gf_install() {
    local flavour sandbox default_index="" source
    if [ "$(id -u)" = 0 ]; then
        gf_warn "installing for root; a volunteer node is better run as a normal user"
    fi
    flavour=$GF_TORCH
    [ "$flavour" != auto ] || flavour=$(gf_torch_auto)
    [ "$flavour" != cpu ] || default_index=https://download.pytorch.org/whl/cpu
    # cuda: PyPI's Linux x86_64 torch wheels are the CUDA build.
    source=${GF_SOURCE:-$(cd "$GF_HERE/../.." && pwd)}
    sandbox=$(gf_resolve_sandbox)

    if [ "$GF_NO_START" = 0 ] && [ "$GF_DRY_RUN" = 0 ] && ! gf_user_manager_up; then
        gf_die "no systemd user manager is reachable (systemctl --user failed); log in with a systemd session, or install with --no-start and start gpuflex-node yourself"
    fi

    gf_say "==> GPUFlex node: hub $GF_HUB${GF_HUB_KEY:+ (pinned key $GF_HUB_KEY)}, torch $flavour, into $GF_PREFIX"
    [ "$GF_DRY_RUN" = 0 ] || gf_say "(dry run: nothing is changed)"
    gf_claim_prefix "$GF_PREFIX"
    gf_mkdir 700 "$GF_NODE_DIR"
    gf_install_venv "$GF_VENV" "$flavour" "$default_index" "$source"

    gf_mkdir 755 "$HOME/.local/bin"
    gf_run ln -sfn "$GF_VENV/bin/gpuflex-node" "$GF_BIN_LINK"

    gf_say "==> writing $GF_UNIT_FILE (sandbox $sandbox)"
    gf_write_service_files "$sandbox"

    if [ "$GF_NO_START" = 1 ]; then
        if [ "$GF_DRY_RUN" = 1 ] || gf_user_manager_up; then
            gf_run_ok systemctl --user daemon-reload
        fi
        gf_say ""
        gf_say "Installed, not started. Start it and run it at every login with:"
        gf_say "  systemctl --user enable --now gpuflex-node"
    else
        gf_say "==> enabling and starting $GF_UNIT_NAME"
        gf_start_unit "$sandbox"
        gf_say ""
        gf_say "The GPUFlex node is running in the background and starts at every login."
        if command -v loginctl >/dev/null 2>&1 \
            && [ "$(loginctl show-user "$(id -un)" -p Linger --value 2>/dev/null || echo yes)" = no ]; then
            gf_say "To keep it running while you are logged out: loginctl enable-linger $(id -un)"
        fi
    fi
    gf_say "  status:    systemctl --user status gpuflex-node"
    gf_say "  logs:      journalctl --user -u gpuflex-node -f"
    gf_say "  node:      $GF_VENV/bin/gpuflex-node status --data-dir \"$GF_NODE_DIR\""
    gf_say "  pause:     systemctl --user stop gpuflex-node    (resume: systemctl --user start gpuflex-node)"
    gf_say "  settings:  $GF_ENV_FILE"
    gf_say "  uninstall: $GF_HERE/$GF_PROG --uninstall$([ "$GF_PREFIX" = "${XDG_DATA_HOME:-$HOME/.local/share}/gpuflex" ] || printf ' --prefix "%s"' "$GF_PREFIX")"
}

gf_uninstall() {
    local manager=0 target
    [ "$GF_DRY_RUN" = 0 ] || gf_say "(dry run: nothing is changed)"
    gf_say "==> removing the GPUFlex node from $GF_PREFIX"
    if [ "$GF_DRY_RUN" = 1 ] || gf_user_manager_up; then
        manager=1
        gf_run_quiet systemctl --user disable --now "$GF_UNIT_NAME"
    fi
    gf_remove_file "$GF_UNIT_DIR/default.target.wants/$GF_UNIT_NAME"
    gf_remove_file "$GF_UNIT_FILE"
    gf_remove_file "$GF_ENV_FILE"
    if [ -L "$GF_BIN_LINK" ]; then
        target=$(readlink "$GF_BIN_LINK" || true)
        case $target in
            "$GF_VENV"/*) gf_remove_file "$GF_BIN_LINK" ;;
        esac
    fi
    gf_remove_prefix "$GF_PREFIX" "$GF_KEEP_IDENTITY"
    if [ "$manager" = 1 ]; then
        gf_run_quiet systemctl --user daemon-reload
        gf_run_quiet systemctl --user reset-failed "$GF_UNIT_NAME"
    fi
    gf_remove_empty_dir "$GF_UNIT_DIR/default.target.wants"
    gf_remove_empty_dir "$GF_UNIT_DIR"
    gf_remove_empty_dir "$GF_CONFIG_HOME/systemd"
    gf_remove_empty_dir "$GF_ENV_DIR"
    gf_say "GPUFlex node removed."
}

gf_main() {
    gf_parse_args "$@"
    gf_linux_paths
    if [ "$GF_PRINT_SERVICE" = 1 ]; then
        [ "$GF_UNINSTALL" = 0 ] || gf_usage_error "--print-service does not go with --uninstall"
        gf_render_unit "$GF_VENV" "$GF_NODE_DIR" "$GF_ENV_FILE" "$GF_HUB" "$GF_HUB_KEY" \
            "$(gf_resolve_sandbox)" "$(gf_systemd_version)"
        return 0
    fi
    if [ "$(uname -s)" != Linux ] && [ "$GF_DRY_RUN" = 0 ]; then
        gf_die "this installer is for Linux; on macOS use installers/macos/install.sh"
    fi
    if [ "$GF_UNINSTALL" = 1 ]; then
        gf_uninstall
    else
        gf_install
    fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    gf_main "$@"
fi
