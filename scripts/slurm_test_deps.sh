#!/bin/bash
# shellcheck shell=bash
# Install what the SLURM tests need (tests/scripts/test_slurm_jobs.py): Debian's slurmctld,
# slurmd, slurm-client and munge, with apt-get, as root or through sudo. Nothing happens
# when they are there already. `make slurm-deps` runs it, and CI runs that:
#
#   bash scripts/slurm_test_deps.sh [--check]
#
# --check: install nothing; exit 0 when every command the tests use is found, else 1,
# naming what is missing. The tests start their own private SLURM (own configuration,
# ports, state and munge key) and never use the system's; the packages' own services are
# not needed.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge)
COMMANDS=(munged slurmctld slurmd sbatch srun scancel scontrol squeue sinfo)

usage() {
    awk 'NR == 1 { next } /^# shellcheck/ { next } /^#/ { sub(/^# ?/, ""); if (!started && $0 == "") next; started = 1; print; next } { exit }' "${BASH_SOURCE[0]}"
}

log() {
    printf '[megatron-ssd] %s\n' "$*"
}

die() {
    printf '[megatron-ssd] ERROR: %s\n' "$*" >&2
    exit 1
}

missing_commands() {
    local c
    for c in "${COMMANDS[@]}"; do
        command -v "$c" >/dev/null 2>&1 || printf '%s\n' "$c"
    done
}

main() {
    local check=0
    while (($# > 0)); do
        case "$1" in
            -h | --help)
                usage
                exit 0
                ;;
            --check)
                check=1
                shift
                ;;
            *)
                usage >&2
                exit 2
                ;;
        esac
    done
    local -a missing sudo=()
    mapfile -t missing < <(missing_commands)
    if ((${#missing[@]} == 0)); then
        log "SLURM and munge are installed: $(slurmctld -V 2>/dev/null || echo slurmctld), $(munged -V 2>/dev/null | head -n 1 || echo munged)"
        exit 0
    fi
    if ((check)); then
        log "missing: ${missing[*]} (bash scripts/slurm_test_deps.sh installs them)"
        exit 1
    fi
    command -v apt-get >/dev/null 2>&1 ||
        die "missing ${missing[*]}, and apt-get is not here: install SLURM (slurmctld, slurmd, the client commands) and munge with this system's package manager"
    if ((EUID != 0)); then
        command -v sudo >/dev/null 2>&1 || die "missing ${missing[*]}: installing needs root (run as root, or install sudo)"
        sudo=(sudo)
    fi
    log "installing ${PACKAGES[*]} (missing: ${missing[*]})"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null
    mapfile -t missing < <(missing_commands)
    ((${#missing[@]} == 0)) || die "still missing after apt-get install: ${missing[*]}"
    log "installed: $(slurmctld -V)"
}

main "$@"
