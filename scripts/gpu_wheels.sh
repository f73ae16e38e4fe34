#!/bin/bash
# shellcheck shell=bash
# Fill the wheel folder that scripts/gpu_check.sh installs from on a GPU machine without a
# package index (docs/getting-started.md, "GPU check"). Run it where pip reaches the index:
# it downloads, for Python 3.12 on x86-64 Linux and without dependencies, what such an image
# (Python 3.12, torch, CuPy, the cuFile libraries, numpy) lacks: megatron-core at the version
# the Makefile pins, and kvikio for CUDA 13 with the libraries it loads (libkvikio,
# rapids-logger, cuda-pathfinder). It keeps one version of each wheel, then prints the
# folder's contents and what the repository and the folder weigh together.
#
#   scripts/gpu_wheels.sh [--dir DIR] [--no-kvikio] [--core-version X.Y.Z]
#   make gpu-wheels
#
# Options:
#   --dir DIR             the wheel folder (default .whl in the repository)
#   --no-kvikio           megatron-core only (the check then skips the kvikio placement, saying so)
#   --core-version X.Y.Z  megatron-core version (default: CORE_VERSION of the Makefile)
#   -h, --help            this text
# Environment: PYTHON (default .venv/bin/python when it exists, else python3) runs pip.
# Not included, on purpose: Transformer Engine (hundreds of MiB of CUDA libraries; its
# tests skip with a reason) and what kvikio's METADATA asks for that the image has
# (cupy-cuda13x, numpy, packaging, the CUDA 13 cuFile library behind cuda-toolkit[cufile]).
# pydantic and what it needs are included: the pretrain part runs Megatron-LM's own
# pretrain_gpt.py, whose training package imports it.
# Exit status: 0 when every wheel is in the folder, 1 when pip failed, 2 on a usage error.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
DIR="$REPO/.whl"
KVIKIO=1
CORE_VERSION=""
# kvikio-cu13 26.10.0 requires libkvikio-cu13==26.10.*; libkvikio-cu13 requires rapids-logger==0.3.*
# and cuda-pathfinder (read from their METADATA Requires-Dist).
KVIKIO_WHEELS=(kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 rapids-logger==0.3.0 cuda-pathfinder==1.9.1)
# pydantic 2.14.4 requires pydantic-core==2.50.5, annotated-types>=0.6 and typing-inspection>=0.4.2
# (typing-extensions is in the image); the versions make's environment installs.
PRETRAIN_WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
    manylinux2014_x86_64 manylinux1_x86_64)
CARRY_LIMIT=$((64 * 1024 * 1024)) # what a GPU run carries: the tree plus the wheels

usage() {
    awk 'NR == 1 { next } /^# shellcheck/ { next } /^#/ { sub(/^# ?/, ""); if (!started && $0 == "") next; started = 1; print; next } { exit }' "${BASH_SOURCE[0]}"
}

die() {
    printf '[gpu_wheels] ERROR: %s\n' "$*" >&2
    exit "${2:-1}"
}

log() {
    printf '[gpu_wheels] %s\n' "$*"
}

parse_args() {
    while (($# > 0)); do
        case "$1" in
            -h | --help)
                usage
                exit 0
                ;;
            --dir | --core-version)
                (($# >= 2)) || die "$1 needs a value (see --help)" 2
                if [[ "$1" == --dir ]]; then DIR="$2"; else CORE_VERSION="$2"; fi
                shift
                ;;
            --no-kvikio) KVIKIO=0 ;;
            *) die "unknown argument $1 (see --help)" 2 ;;
        esac
        shift
    done
    if [[ -z "$CORE_VERSION" ]]; then
        CORE_VERSION="$(awk -F ':= *' '/^CORE_VERSION *:=/ { print $2; exit }' "$REPO/Makefile")"
    fi
    [[ "$CORE_VERSION" =~ ^[0-9]+(\.[0-9]+)+$ ]] || die "--core-version '$CORE_VERSION': must be a version such as 0.19.2" 2
}

# The file-name prefix of a distribution's wheels: lower case, runs of - _ . as one _.
wheel_prefix() {
    local name="${1%%==*}"
    name="${name,,}"
    printf '%s\n' "${name//[-.]/_}"
}

# Remove the wheels of the distribution of requirement $1 (NAME==VERSION) whose version is
# not VERSION: one version of each wheel stays.
remove_other_versions() {
    local req="$1" prefix version f
    prefix="$(wheel_prefix "$req")"
    version="${req#*==}"
    for f in "$DIR/$prefix"-*.whl; do
        [[ -e "$f" ]] || continue
        if [[ "$(basename "$f")" != "$prefix-$version-"* ]]; then
            log "removing $(basename "$f") (keeping $version)"
            rm -f "$f"
        fi
    done
}

main() {
    parse_args "$@"
    local py="${PYTHON:-}" req total tree
    if [[ -z "$py" ]]; then
        if [[ -x "$REPO/.venv/bin/python" ]]; then py="$REPO/.venv/bin/python"; else py=python3; fi
    fi
    local -a reqs=("megatron-core==$CORE_VERSION" "${PRETRAIN_WHEELS[@]}") platform_args=()
    if ((KVIKIO)); then
        reqs+=("${KVIKIO_WHEELS[@]}")
    fi
    for req in "${PLATFORMS[@]}"; do
        platform_args+=(--platform "$req")
    done
    mkdir -p "$DIR"
    for req in "${reqs[@]}"; do
        remove_other_versions "$req"
    done
    local -a cmd=("$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        "${platform_args[@]}" -d "$DIR" "${reqs[@]}")
    printf '+ %s\n' "${cmd[*]}"
    "${cmd[@]}" || die "pip download failed (is the package index reachable from here?)"
    log "wheel folder $DIR:"
    ls -l "$DIR"
    total="$(du -cb "$DIR"/*.whl | tail -n 1 | cut -f 1)"
    if tree="$(cd "$REPO" && git ls-files -z 2>/dev/null | xargs -0 du -cb 2>/dev/null | awk '$2 == "total" { s += $1 } END { print s + 0 }')" &&
        ((tree > 0)); then
        log "wheels $((total / 1024)) KiB + tracked files $((tree / 1024)) KiB = $(((total + tree) / 1024)) KiB" \
            "of the $((CARRY_LIMIT / 1024)) KiB a GPU run carries"
        if ((total + tree > CARRY_LIMIT)); then
            log "WARNING: over the limit: run with --no-kvikio, or carry the wheels in a second call"
        fi
    else
        log "wheels $((total / 1024)) KiB"
    fi
}

main "$@"
