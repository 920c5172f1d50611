#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# GPUFlex node installer for macOS: a venv in ~/Library/Application Support/gpuflex
# and a launchd agent that runs `gpuflex-node run` in the background at low
# priority. No admin rights needed. Re-running upgrades in place; --uninstall
# removes everything it made. Runs on the bash 3.2 that macOS ships.
# See installers/README.md.
set -euo pipefail

GF_PROG=$(basename "$0")
GF_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../lib/common.sh
. "$GF_HERE/../lib/common.sh"

GF_LABEL=org.gpuflex.node

gf_usage() {
    cat <<EOF
usage: $GF_PROG --hub URL [--hub-key FPR] [--prefix DIR] [--torch cpu|auto]
                [--source PATH_OR_SPEC] [--no-start] [--dry-run]
       $GF_PROG --uninstall [--keep-identity] [--prefix DIR] [--dry-run]

Installs the GPUFlex volunteer node for this user: a venv in
~/Library/Application Support/gpuflex (or --prefix) and the launchd agent
~/Library/LaunchAgents/$GF_LABEL.plist, then loads it.

  --hub URL           hub to train for (required to install)
  --hub-key FPR       pin the hub's key fingerprint (gf1-...); without it the node
                      trusts the key it sees first
  --prefix DIR        install folder (default: ~/Library/Application Support/gpuflex)
  --torch KIND        cpu or auto (both: PyPI's macOS build, which uses the Apple GPU
                      through MPS); cuda does not exist on macOS
  --source SRC        where gpuflex comes from: a source folder or a pip requirement
                      (default: the repository this script is in)
  --no-start          install, but do not load the agent
  --dry-run           print every action, change nothing
  --uninstall         unload and remove the node, its venv and agent
  --keep-identity     with --uninstall: keep node.key and hub.pin
  --print-service     print the launchd plist this would install and exit

Environment: GPUFLEX_TORCH_SPEC (pip requirement for torch, default "torch"),
GPUFLEX_TORCH_INDEX (pip index for torch; default: pip's own configuration),
GPUFLEX_NODE_ARGS (extra flags for "gpuflex-node run", split on spaces), GPUFLEX_PYTHON.
EOF
}

gf_macos_paths() {
    [ -n "${HOME:-}" ] || gf_die "HOME is not set"
    [ -n "$GF_PREFIX" ] || GF_PREFIX="$HOME/Library/Application Support/gpuflex"
    GF_VENV=$GF_PREFIX/venv
    GF_NODE_DIR=$GF_PREFIX/node
    GF_LOG_DIR=$GF_PREFIX/logs
    GF_AGENT_DIR=$HOME/Library/LaunchAgents
    GF_PLIST=$GF_AGENT_DIR/$GF_LABEL.plist
    gf_check_path_chars "install folder" "$GF_PREFIX"
    gf_check_path_chars "home folder" "$HOME"
}

gf_xml_escape() { # sed, not ${s//&/...}: bash 5.2 gives '&' a meaning in replacements
    printf '%s' "$1" | sed -e 's/&/\&amp;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g'
}

# gf_render_plist LABEL VENV NODE_DIR LOG_DIR HUB HUB_KEY [EXTRA_ARG...]
# Prints the launchd agent. Tests parse it with plistlib.
gf_render_plist() {
    local label=$1 venv=$2 node_dir=$3 log_dir=$4 hub=$5 hub_key=$6 arg
    shift 6
    cat <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">
<!-- GPUFlex volunteer node, written by installers/macos/install.sh (its uninstall option removes it). -->
<plist version="1.0">
<dict>
  <key>Label</key>
  <string>$(gf_xml_escape "$label")</string>
  <key>ProgramArguments</key>
  <array>
    <string>$(gf_xml_escape "$venv/bin/gpuflex-node")</string>
    <string>run</string>
    <string>--hub</string>
    <string>$(gf_xml_escape "$hub")</string>
EOF
    if [ -n "$hub_key" ]; then
        printf '    <string>--hub-key</string>\n    <string>%s</string>\n' "$(gf_xml_escape "$hub_key")"
    fi
    printf '    <string>--data-dir</string>\n    <string>%s</string>\n' "$(gf_xml_escape "$node_dir")"
    for arg in "$@"; do
        printf '    <string>%s</string>\n' "$(gf_xml_escape "$arg")"
    done
    cat <<EOF
  </array>
  <key>WorkingDirectory</key>
  <string>$(gf_xml_escape "$node_dir")</string>
  <key>EnvironmentVariables</key>
  <dict>
    <key>PYTHONUNBUFFERED</key>
    <string>1</string>
  </dict>
  <key>RunAtLoad</key>
  <true/>
  <key>KeepAlive</key>
  <dict>
    <key>SuccessfulExit</key>
    <false/>
  </dict>
  <key>ThrottleInterval</key>
  <integer>30</integer>
  <key>ProcessType</key>
  <string>Background</string>
  <key>LowPriorityIO</key>
  <true/>
  <key>LowPriorityBackgroundIO</key>
  <true/>
  <key>Nice</key>
  <integer>19</integer>
  <key>Umask</key>
  <integer>63</integer>
  <key>StandardOutPath</key>
  <string>$(gf_xml_escape "$log_dir/node.log")</string>
  <key>StandardErrorPath</key>
  <string>$(gf_xml_escape "$log_dir/node.log")</string>
</dict>
</plist>
EOF
}

gf_node_extra_args() { # GPUFLEX_NODE_ARGS split on whitespace, one per line
    local word
    # shellcheck disable=SC2086  # splitting is the point
    for word in ${GPUFLEX_NODE_ARGS:-}; do
        printf '%s\n' "$word"
    done
}

gf_plist_text() {
    local -a extra
    extra=()
    local word
    while IFS= read -r word; do
        if [ -n "$word" ]; then
            extra[${#extra[@]}]=$word
        fi
    done <<EOF
$(gf_node_extra_args)
EOF
    gf_render_plist "$GF_LABEL" "$GF_VENV" "$GF_NODE_DIR" "$GF_LOG_DIR" "$GF_HUB" "$GF_HUB_KEY" \
        ${extra[@]+"${extra[@]}"}
}

gf_domain() { printf 'gui/%s' "$(id -u)"; }

gf_install() {
    local flavour=cpu source
    source=${GF_SOURCE:-$(cd "$GF_HERE/../.." && pwd)}

    gf_say "==> GPUFlex node: hub $GF_HUB${GF_HUB_KEY:+ (pinned key $GF_HUB_KEY)}, into $GF_PREFIX"
    [ "$GF_DRY_RUN" = 0 ] || gf_say "(dry run: nothing is changed)"
    gf_claim_prefix "$GF_PREFIX"
    gf_mkdir 700 "$GF_NODE_DIR"
    gf_mkdir 700 "$GF_LOG_DIR"
    # macOS wheels on PyPI are the only build (CPU + MPS): no special index.
    gf_install_venv "$GF_VENV" "$flavour" "" "$source"

    gf_say "==> writing $GF_PLIST"
    gf_mkdir 755 "$GF_AGENT_DIR"
    gf_write_file "$GF_PLIST" 644 "$(gf_plist_text)"
    if command -v plutil >/dev/null 2>&1; then
        gf_run plutil -lint "$GF_PLIST" || gf_die "plutil -lint rejected $GF_PLIST"
    fi

    if [ "$GF_NO_START" = 1 ]; then
        gf_say ""
        gf_say "Installed, not started. Start it (and at every login) with:"
        gf_say "  launchctl bootstrap $(gf_domain) \"$GF_PLIST\""
    else
        gf_say "==> loading the launchd agent $GF_LABEL"
        # bootout first so a re-run picks up the new plist and venv.
        gf_run_quiet launchctl bootout "$(gf_domain)/$GF_LABEL"
        gf_run launchctl enable "$(gf_domain)/$GF_LABEL" || gf_die "launchctl enable $GF_LABEL failed"
        gf_run launchctl bootstrap "$(gf_domain)" "$GF_PLIST" \
            || gf_die "launchctl bootstrap $(gf_domain) $GF_PLIST failed; see $GF_LOG_DIR/node.log"
        gf_say ""
        gf_say "The GPUFlex node is running in the background and starts at every login."
    fi
    gf_say "  status:    launchctl print $(gf_domain)/$GF_LABEL"
    gf_say "  logs:      tail -f \"$GF_LOG_DIR/node.log\""
    gf_say "  node:      \"$GF_VENV/bin/gpuflex-node\" status --data-dir \"$GF_NODE_DIR\""
    gf_say "  pause:     launchctl bootout $(gf_domain)/$GF_LABEL    (resume: launchctl bootstrap $(gf_domain) \"$GF_PLIST\")"
    gf_say "  uninstall: \"$GF_HERE/$GF_PROG\" --uninstall"
}

gf_uninstall() {
    [ "$GF_DRY_RUN" = 0 ] || gf_say "(dry run: nothing is changed)"
    gf_say "==> removing the GPUFlex node from $GF_PREFIX"
    if [ "$GF_DRY_RUN" = 1 ] || command -v launchctl >/dev/null 2>&1; then
        gf_run_quiet launchctl bootout "$(gf_domain)/$GF_LABEL"
    fi
    gf_remove_file "$GF_PLIST"
    gf_remove_prefix "$GF_PREFIX" "$GF_KEEP_IDENTITY"
    gf_say "GPUFlex node removed."
}

gf_main() {
    gf_parse_args "$@"
    if [ "$GF_TORCH" = cuda ]; then
        gf_usage_error "--torch cuda: PyTorch has no CUDA build for macOS; use --torch auto (Apple GPUs work through MPS)"
    fi
    gf_macos_paths
    if [ "$GF_PRINT_SERVICE" = 1 ]; then
        [ "$GF_UNINSTALL" = 0 ] || gf_usage_error "--print-service does not go with --uninstall"
        gf_plist_text
        return 0
    fi
    if [ "$(uname -s)" != Darwin ] && [ "$GF_DRY_RUN" = 0 ]; then
        gf_die "this installer is for macOS; on Linux use installers/linux/install.sh"
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
