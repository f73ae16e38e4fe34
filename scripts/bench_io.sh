#!/bin/bash
# shellcheck shell=bash
# Measure this node's NVMe offload bandwidth twice: with megatron-ssd's own engine
# ("megatron-ssd bench-io", which also suggests I/O settings), then with fio using the
# same access pattern (scripts/fio_offload.sh), so the two can be compared.
#
#   scripts/bench_io.sh [--size SIZE] [--jobs N] [--no-fio] [PATH...]
#   NVME_MOUNTS="/mnt/nvme0 /mnt/nvme1" scripts/bench_io.sh
#   srun --nodes=1 --exclusive scripts/bench_io.sh /mnt/nvme_raid0/megatron-ssd
#
# Options:
#   --size SIZE    fio: bytes per worker thread (default 4G)
#   --jobs N       fio: worker threads per directory (default 2, the engine's io.threads)
#   --no-fio       run only megatron-ssd bench-io
#   -h, --help     this text
# Without PATH: every mount of NVME_MOUNTS (default /mnt/nvme_raid0), or its
# OFFLOAD_SUBDIR (default megatron-ssd) when that directory exists.
# Environment: MEGATRON_SSD (default megatron-ssd), BENCH_IO_ARGS (more bench-io flags,
# whitespace-separated, e.g. BENCH_IO_ARGS="--size 4GiB --json bench.json").
# Exit status: 0 when bench-io succeeded (a missing fio is reported, not fatal), 1 otherwise.
set -euo pipefail

ms_here="${BASH_SOURCE[0]%/*}"
[[ "$ms_here" == "${BASH_SOURCE[0]}" ]] && ms_here=.
# shellcheck source=common.sh
source "$ms_here/common.sh"

FIO_ARGS=()
RUN_FIO=1
PATHS=()

usage() {
    awk 'NR == 1 { next } /^# shellcheck/ { next } /^#/ { sub(/^# ?/, ""); if (!started && $0 == "") next; started = 1; print; next } { exit }' "${BASH_SOURCE[0]}"
}

log() {
    printf '[bench_io] %s\n' "$*"
}

die() {
    printf '[bench_io] ERROR: %s\n' "$*" >&2
    exit 1
}

parse_args() {
    while (($# > 0)); do
        case "$1" in
            -h | --help)
                usage
                exit 0
                ;;
            --no-fio) RUN_FIO=0 ;;
            --size | --jobs)
                (($# >= 2)) || die "$1 needs a value"
                FIO_ARGS+=("$1" "$2")
                shift
                ;;
            --)
                shift
                PATHS+=("$@")
                break
                ;;
            -*) die "unknown option $1 (see --help)" ;;
            *) PATHS+=("$1") ;;
        esac
        shift
    done
    if ((${#PATHS[@]} == 0)); then
        mapfile -t PATHS < <(ms_default_offload_dirs)
    fi
    local p
    for p in "${PATHS[@]}"; do
        [[ -d "$p" ]] || die "$p is not a directory (give the NVMe offload directories, or set NVME_MOUNTS)"
    done
}

run_bench_io() {
    local -a cli extra
    read -r -a cli <<<"${MEGATRON_SSD:-megatron-ssd}"
    read -r -a extra <<<"${BENCH_IO_ARGS:-}"
    if ! command -v "${cli[0]}" >/dev/null 2>&1; then
        printf '[bench_io] ERROR: %s not found on PATH (activate the environment holding megatron-ssd, or set MEGATRON_SSD)\n' "${cli[0]}" >&2
        return 1
    fi
    local -a cmd=("${cli[@]}" bench-io "${extra[@]}" "${PATHS[@]}")
    log "megatron-ssd engine on $(hostname):"
    printf '+ %s\n' "${cmd[*]}"
    "${cmd[@]}"
}

run_fio_compare() {
    local script_dir rc=0
    script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
    log "fio with the same pattern, for comparison:"
    bash "$script_dir/fio_offload.sh" "${FIO_ARGS[@]}" "${PATHS[@]}" || rc=$?
    case "$rc" in
        0) log "engine numbers within about 10% of fio's mean the offload engine is not the bottleneck; a large gap: try more io.threads (OVERRIDES=io.threads=N)" ;;
        3) log "fio is not installed: only the megatron-ssd numbers above (see the hints printed)" ;;
        *) printf '[bench_io] WARNING: fio failed (exit %s)\n' "$rc" >&2 ;;
    esac
}

main() {
    parse_args "$@"
    local status=0
    run_bench_io || status=1
    if ((RUN_FIO)); then
        run_fio_compare
    fi
    exit "$status"
}

main "$@"
