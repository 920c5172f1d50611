# shellcheck shell=bash
# Variables set here are read by the installer that sources this file:
# shellcheck disable=SC2034
# Shared by installers/linux/install.sh and installers/macos/install.sh.
#
# Written for bash 3.2 (what macOS ships): no associative arrays, no ${x,,},
# no mapfile, and an array that may be empty is expanded as ${a[@]+"${a[@]}"}.
#
# Everything the installers do to the machine goes through gf_run / gf_write_file /
# gf_remove_*, so --dry-run prints every action and performs none.

GF_PROG=${GF_PROG:-install.sh}

# ----------------------------------------------------------------------------- messages

gf_die() { # one-line error, exit 1
    printf '%s: error: %s\n' "$GF_PROG" "$*" >&2
    exit 1
}

gf_usage_error() { # one-line error about the command line, exit 2
    printf '%s: error: %s (see %s --help)\n' "$GF_PROG" "$*" "$GF_PROG" >&2
    exit 2
}

gf_warn() { printf '%s: warning: %s\n' "$GF_PROG" "$*" >&2; }
gf_say() { printf '%s\n' "$*"; }

gf_quote_cmd() { # print "$@" as one shell-quoted line
    local out="" a
    for a in "$@"; do
        out="$out $(printf '%q' "$a")"
    done
    printf '%s' "${out# }"
}

# ----------------------------------------------------------------------------- actions

gf_run() { # run a command, or only print it under --dry-run
    if [ "$GF_DRY_RUN" = 1 ]; then
        printf '+ %s\n' "$(gf_quote_cmd "$@")"
        return 0
    fi
    "$@"
}

gf_run_ok() { # like gf_run, but a failure is not fatal (returns its status)
    if [ "$GF_DRY_RUN" = 1 ]; then
        printf '+ %s || true\n' "$(gf_quote_cmd "$@")"
        return 0
    fi
    "$@"
}

gf_run_quiet() { # gf_run_ok with its output and failure swallowed
    if [ "$GF_DRY_RUN" = 1 ]; then
        printf '+ %s || true\n' "$(gf_quote_cmd "$@")"
        return 0
    fi
    "$@" >/dev/null 2>&1 || true
}

gf_mkdir() { # mkdir -p with a mode, printed under --dry-run
    local mode=$1 dir=$2
    [ -d "$dir" ] && return 0
    gf_run mkdir -p -m "$mode" "$dir"
}

gf_write_file() { # gf_write_file PATH MODE CONTENT: atomic write (temp file + rename)
    local path=$1 mode=$2 content=$3 tmp
    if [ "$GF_DRY_RUN" = 1 ]; then
        printf '+ write %s (mode %s):\n' "$path" "$mode"
        printf '%s\n' "$content" | sed 's/^/    | /'
        return 0
    fi
    tmp="$path.tmp.$$"
    (umask 077 && printf '%s\n' "$content" >"$tmp") || gf_die "cannot write $tmp"
    chmod "$mode" "$tmp" || gf_die "cannot chmod $tmp"
    mv -f "$tmp" "$path" || gf_die "cannot move $tmp to $path"
}

gf_remove_file() { # rm -f, printed under --dry-run; silent when absent
    if [ -e "$1" ] || [ -L "$1" ]; then
        gf_run rm -f "$1"
    fi
}

gf_remove_empty_dir() { # rmdir only when it exists and is empty
    local dir=$1
    [ -d "$dir" ] || return 0
    if [ "$GF_DRY_RUN" = 1 ]; then
        printf '+ rmdir %s  # if empty\n' "$(printf '%q' "$dir")"
        return 0
    fi
    if [ -z "$(ls -A "$dir" 2>/dev/null)" ]; then
        gf_run rmdir "$dir"
    fi
}

# ----------------------------------------------------------------------------- arguments

# Set here, read by the installer that sources this file.
GF_HUB=""
GF_HUB_KEY=""
GF_PREFIX=""
GF_NO_START=0
GF_DRY_RUN=0
GF_UNINSTALL=0
GF_KEEP_IDENTITY=0
GF_TORCH=auto
GF_SOURCE=""
GF_SANDBOX=auto
GF_PRINT_SERVICE=0

gf_need_value() { # gf_need_value FLAG NEXT_ARG_COUNT
    [ "$2" -ge 2 ] || gf_usage_error "$1 needs a value"
}

gf_parse_args() {
    local arg val
    while [ $# -gt 0 ]; do
        arg=$1
        val=""
        case $arg in
            --*=*)
                val=${arg#*=}
                arg=${arg%%=*}
                set -- "$arg" "$val" "${@:2}"
                ;;
        esac
        case $arg in
            -h | --help) gf_usage; exit 0 ;;
            --hub) gf_need_value "$arg" $#; GF_HUB=$2; shift 2 ;;
            --hub-key) gf_need_value "$arg" $#; GF_HUB_KEY=$2; shift 2 ;;
            --prefix) gf_need_value "$arg" $#; GF_PREFIX=$2; shift 2 ;;
            --torch) gf_need_value "$arg" $#; GF_TORCH=$2; shift 2 ;;
            --source) gf_need_value "$arg" $#; GF_SOURCE=$2; shift 2 ;;
            --sandbox) gf_need_value "$arg" $#; GF_SANDBOX=$2; shift 2 ;;
            --no-start) GF_NO_START=1; shift ;;
            --dry-run) GF_DRY_RUN=1; shift ;;
            --uninstall) GF_UNINSTALL=1; shift ;;
            --keep-identity) GF_KEEP_IDENTITY=1; shift ;;
            --print-service) GF_PRINT_SERVICE=1; shift ;;
            *) gf_usage_error "unknown argument: $arg" ;;
        esac
    done

    case $GF_TORCH in
        cpu | cuda | auto) ;;
        *) gf_usage_error "--torch must be cpu, cuda or auto, not '$GF_TORCH'" ;;
    esac
    case $GF_SANDBOX in
        auto | on | off) ;;
        *) gf_usage_error "--sandbox must be auto, on or off, not '$GF_SANDBOX'" ;;
    esac
    if [ "$GF_KEEP_IDENTITY" = 1 ] && [ "$GF_UNINSTALL" = 0 ]; then
        gf_usage_error "--keep-identity only goes with --uninstall"
    fi
    if [ "$GF_UNINSTALL" = 0 ]; then
        [ -n "$GF_HUB" ] || gf_usage_error "--hub URL is required (the hub this node trains for, e.g. --hub https://hub.example.org:8470)"
        gf_check_hub_url "$GF_HUB"
        [ -z "$GF_HUB_KEY" ] || gf_check_hub_key "$GF_HUB_KEY"
    fi
    if [ -n "$GF_PREFIX" ]; then
        case $GF_PREFIX in
            /*) ;;
            *) GF_PREFIX="$PWD/$GF_PREFIX" ;;
        esac
        GF_PREFIX=${GF_PREFIX%/}
        [ -n "$GF_PREFIX" ] || gf_usage_error "--prefix cannot be /"
    fi
}

gf_check_hub_url() {
    if ! [[ $1 =~ ^https?://[^[:space:]]+$ ]]; then
        gf_usage_error "--hub must be an http:// or https:// URL, not '$1'"
    fi
    case $1 in
        *[\"\'\\\`\$%\<\>\&]*)
            gf_usage_error "--hub URL contains a character the service files cannot carry (one of \" ' \\ \` \$ % < > &): '$1'"
            ;;
    esac
}

gf_check_hub_key() {
    if ! [[ $1 =~ ^gf1(-[a-z2-7]{4}){5}$ ]]; then
        gf_usage_error "--hub-key must be a hub key fingerprint like gf1-abcd-efgh-ijkl-mnop-qrst (ask the hub operator), not '$1'"
    fi
}

gf_check_path_chars() { # gf_check_path_chars WHAT PATH: keep paths safe for unit files and plists
    case $2 in
        *[!A-Za-z0-9\ ._/+@,:~-]*)
            gf_usage_error "$1 '$2' has characters other than letters, digits, space and ._/+@,:~- ; choose another with --prefix"
            ;;
    esac
}

# ----------------------------------------------------------------------------- python + pip

gf_find_python() { # prints a python >= 3.11 that can create venvs
    local cand
    for cand in ${GPUFLEX_PYTHON:-} python3.13 python3.12 python3.11 python3; do
        command -v "$cand" >/dev/null 2>&1 || continue
        if "$cand" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
            command -v "$cand"
            return 0
        fi
    done
    return 1
}

gf_torch_flavour_installed() { # prints cuda|cpu|none for the venv's torch
    # Reads torch/version.py instead of importing torch (seconds, more without bytecode).
    local py=$1
    [ -x "$py" ] || { echo none; return 0; }
    "$py" -c 'import importlib.util, pathlib, re
spec = importlib.util.find_spec("torch")
if spec is None or not spec.origin:
    print("none")
else:
    text = (pathlib.Path(spec.origin).parent / "version.py").read_text()
    m = re.search(r"^cuda\s*(?::[^=]*)?=\s*(.+)$", text, re.M)
    print("cpu" if m is None or m.group(1).strip() == "None" else "cuda")' 2>/dev/null || echo none
}

# gf_install_venv VENV TORCH_FLAVOUR DEFAULT_TORCH_INDEX SOURCE
# Creates or upgrades the venv in place: torch first (the build chosen for this
# machine), then gpuflex from SOURCE (a directory is copied to a temp dir first so
# the build never writes into the source tree; with the cuda flavour it gets the
# [gpu] extra, which lets the node see other processes on the GPU).
gf_install_venv() {
    local venv=$1 flavour=$2 default_index=$3 source=$4 extra=""
    [ "$flavour" != cuda ] || extra="[gpu]"
    local py="$venv/bin/python" base_py torch_spec torch_index have reinstall=""
    local -a pip_common
    pip_common=(-m pip install --disable-pip-version-check --no-input)

    if [ -x "$py" ] && "$py" -c 'import sys' >/dev/null 2>&1; then
        gf_say "==> upgrading the existing venv in $venv"
    else
        base_py=$(gf_find_python) || gf_die "no Python >= 3.11 with the venv module found; install python3 (Debian/Ubuntu: apt-get install python3 python3-venv) or set GPUFLEX_PYTHON=/path/to/python3.11"
        gf_say "==> creating a venv in $venv (with $base_py)"
        gf_run "$base_py" -m venv --clear "$venv"
    fi

    torch_spec=${GPUFLEX_TORCH_SPEC:-torch}
    # Unset -> the default index for this flavour; set but empty -> plain pip config.
    torch_index=${GPUFLEX_TORCH_INDEX-$default_index}
    have=$(gf_torch_flavour_installed "$py")
    if [ "$have" != none ] && [ "$have" != "$flavour" ]; then
        gf_say "==> replacing the installed $have build of torch with the $flavour build"
        reinstall=--force-reinstall
    fi
    gf_say "==> installing torch ($flavour build: $torch_spec${torch_index:+ from $torch_index})"
    if [ -n "$torch_index" ]; then
        gf_run "$py" "${pip_common[@]}" ${reinstall:+"$reinstall"} --index-url "$torch_index" "$torch_spec" \
            || gf_die "pip could not install $torch_spec from $torch_index"
    else
        gf_run "$py" "${pip_common[@]}" ${reinstall:+"$reinstall"} "$torch_spec" \
            || gf_die "pip could not install $torch_spec"
    fi

    if [ -d "$source" ]; then
        [ -f "$source/pyproject.toml" ] || gf_die "--source $source is a directory without pyproject.toml"
        gf_say "==> installing gpuflex from $source"
        local stage
        local -a excludes
        excludes=(--exclude=.git --exclude=.venv --exclude=build --exclude=dist --exclude='*.egg-info'
            --exclude=__pycache__ --exclude=.pytest_cache --exclude=.mypy_cache --exclude=.ruff_cache
            --exclude=.hypothesis)
        if [ "$GF_DRY_RUN" = 1 ]; then
            gf_say "+ STAGE=\$(mktemp -d)"
            gf_say "+ $(gf_quote_cmd tar -C "$source" "${excludes[@]}" -cf - .) | tar -C \"\$STAGE\" -xf -"
            gf_say "+ $(gf_quote_cmd "$py" "${pip_common[@]}" --upgrade --upgrade-strategy only-if-needed) \"\$STAGE$extra\""
            gf_say "+ rm -rf \"\$STAGE\""
        else
            stage=$(mktemp -d "${TMPDIR:-/tmp}/gpuflex-src.XXXXXX") || gf_die "mktemp failed"
            # shellcheck disable=SC2064  # expand $stage now
            trap "rm -rf '$stage'" EXIT
            (tar -C "$source" "${excludes[@]}" -cf - . | tar -C "$stage" -xf -) \
                || gf_die "cannot copy the source tree $source"
            "$py" "${pip_common[@]}" --upgrade --upgrade-strategy only-if-needed "$stage$extra" \
                || gf_die "pip could not install gpuflex from $source"
            rm -rf "$stage"
            trap - EXIT
        fi
    else
        gf_say "==> installing gpuflex from $source"
        gf_run "$py" "${pip_common[@]}" --upgrade --upgrade-strategy only-if-needed "$source" \
            || gf_die "pip could not install gpuflex from '$source'"
    fi

    if [ "$GF_DRY_RUN" = 0 ]; then
        "$venv/bin/gpuflex-node" --version >/dev/null 2>&1 \
            || gf_die "the installed $venv/bin/gpuflex-node does not run ('gpuflex-node --version' failed)"
    else
        gf_run "$venv/bin/gpuflex-node" --version
    fi
}

# ----------------------------------------------------------------------------- install folder

GF_MARKER=.gpuflex-install

gf_claim_prefix() { # refuse to install into a non-empty folder we did not create
    local prefix=$1
    if [ -d "$prefix" ] && [ ! -e "$prefix/$GF_MARKER" ] && [ -n "$(ls -A "$prefix" 2>/dev/null)" ]; then
        gf_die "$prefix exists, is not empty and was not made by this installer; choose an empty folder with --prefix"
    fi
    gf_mkdir 700 "$prefix"
    if [ ! -e "$prefix/$GF_MARKER" ]; then
        gf_write_file "$prefix/$GF_MARKER" 600 "This folder belongs to the GPUFlex node installer; its --uninstall removes it."
    fi
}

# gf_remove_prefix PREFIX KEEP_IDENTITY: removes the whole install folder, or all
# but the node identity (node/node.key and the pinned hub key node/hub.pin).
gf_remove_prefix() {
    local prefix=$1 keep=$2 entry
    [ -d "$prefix" ] || return 0
    case $prefix in
        / | "$HOME" | "$HOME/") gf_die "refusing to remove $prefix" ;;
    esac
    if [ ! -e "$prefix/$GF_MARKER" ]; then
        gf_warn "$prefix has no $GF_MARKER marker; leaving it alone (remove it yourself if it is GPUFlex's)"
        return 0
    fi
    if [ "$keep" = 0 ]; then
        gf_run rm -rf "$prefix"
        return 0
    fi
    for entry in "$prefix"/* "$prefix"/.[!.]*; do
        [ -e "$entry" ] || [ -L "$entry" ] || continue
        case ${entry##*/} in
            node | "$GF_MARKER") ;;
            *) gf_run rm -rf "$entry" ;;
        esac
    done
    if [ -d "$prefix/node" ]; then
        for entry in "$prefix/node"/* "$prefix/node"/.[!.]*; do
            [ -e "$entry" ] || [ -L "$entry" ] || continue
            case ${entry##*/} in
                node.key | hub.pin) ;;
                *) gf_run rm -rf "$entry" ;;
            esac
        done
    fi
    gf_say "kept the node identity in $prefix/node (node.key, hub.pin); delete that folder to forget it"
}

gf_torch_auto() { # cuda when nvidia-smi sees a GPU, else cpu
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo cuda
    else
        echo cpu
    fi
}
