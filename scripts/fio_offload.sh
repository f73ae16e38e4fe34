#!/bin/bash
# shellcheck shell=bash
# fio benchmark with megatron-ssd's offload access pattern: O_DIRECT, large blocks
# (4 MiB by default, like io.block_bytes), several worker threads (like io.threads)
# each writing its own file sequentially, then reading it back. Prints write and read
# bandwidth per directory, then for all directories at once (the engine stripes blocks
# over every offload path of a GPU, so the aggregate is what one GPU can get).
#
#   scripts/fio_offload.sh [OPTIONS] DIR...
#   scripts/fio_offload.sh --size 8G --jobs 4 /mnt/nvme0/megatron-ssd /mnt/nvme1/megatron-ssd
#
# Options:
#   --size SIZE         bytes per job file, fio syntax: 512M, 4G (default 4G)
#   --bs SIZE           block size, a multiple of 4096 (default 4M)
#   --jobs N            worker threads per directory (default 2, the engine's io.threads)
#   --ioengine ENGINE   psync (default: one blocking request per thread, like the posix
#                       engine) or libaio (with --iodepth requests in flight per thread)
#   --iodepth N         requests in flight per thread with libaio (default 1)
#   --no-aggregate      skip the all-directories-at-once run
#   --keep              keep the test files (default: removed at exit)
#   -h, --help          this text
# Without DIR: every mount of NVME_MOUNTS (default /mnt/nvme_raid0), or its
# OFFLOAD_SUBDIR (default megatron-ssd) when that directory exists.
# Needs jobs x size free in each directory. Exit status: 0 measured, 1 failed,
# 2 bad usage, 3 fio is not installed (installation hints printed).
set -euo pipefail

SIZE="4G"
BS="4M"
JOBS=2
IOENGINE="psync"
IODEPTH=1
AGGREGATE=1
KEEP=0
DIRS=()
WORK_DIRS=()

usage() {
    awk 'NR == 1 { next } /^# shellcheck/ { next } /^#/ { sub(/^# ?/, ""); if (!started && $0 == "") next; started = 1; print; next } { exit }' "${BASH_SOURCE[0]}"
}

log() {
    printf '[fio_offload] %s\n' "$*"
}

die() {
    printf '[fio_offload] ERROR: %s\n' "$*" >&2
    exit 1
}

usage_error() {
    printf '[fio_offload] ERROR: %s (see --help)\n' "$*" >&2
    exit 2
}

explain_fio_install() {
    cat >&2 <<'EOF'
[fio_offload] fio is not installed (or not on PATH). Install it with one of:
    Debian / Ubuntu:     sudo apt-get install fio
    RHEL / Rocky / Alma: sudo dnf install fio
    SUSE:                sudo zypper install fio
    Spack:               spack install fio && spack load fio
    conda:               conda install -c conda-forge fio
    from source:         git clone https://github.com/axboe/fio && cd fio && ./configure && make && sudo make install
Without root, build from source with ./configure --prefix="$HOME/.local" and put
$HOME/.local/bin on PATH. "megatron-ssd bench-io DIR..." measures the same pattern
without fio.
EOF
}

# SIZE with an optional K/M/G/T suffix (powers of 1024, as fio reads them) -> bytes.
to_bytes() {
    local value="$1" num unit
    if [[ ! "$value" =~ ^([0-9]+)([KkMmGgTt]?)([iI]?[bB]?)$ ]]; then
        return 1
    fi
    num="${BASH_REMATCH[1]}"
    unit="${BASH_REMATCH[2],,}"
    case "$unit" in
        k) num=$((num << 10)) ;;
        m) num=$((num << 20)) ;;
        g) num=$((num << 30)) ;;
        t) num=$((num << 40)) ;;
    esac
    printf '%s\n' "$num"
}

ms_here="${BASH_SOURCE[0]%/*}"
[[ "$ms_here" == "${BASH_SOURCE[0]}" ]] && ms_here=.
# shellcheck source=common.sh
source "$ms_here/common.sh"
quote_cmd() { ms_quote_cmd "$@"; }

parse_args() {
    while (($# > 0)); do
        case "$1" in
            -h | --help)
                usage
                exit 0
                ;;
            --no-aggregate) AGGREGATE=0 ;;
            --keep) KEEP=1 ;;
            --size | --bs | --jobs | --ioengine | --iodepth)
                (($# >= 2)) || usage_error "$1 needs a value"
                case "$1" in
                    --size) SIZE="$2" ;;
                    --bs) BS="$2" ;;
                    --jobs) JOBS="$2" ;;
                    --ioengine) IOENGINE="$2" ;;
                    --iodepth) IODEPTH="$2" ;;
                esac
                shift
                ;;
            --)
                shift
                DIRS+=("$@")
                break
                ;;
            -*) usage_error "unknown option $1" ;;
            *) DIRS+=("$1") ;;
        esac
        shift
    done
    local bs_bytes
    to_bytes "$SIZE" >/dev/null || usage_error "--size $SIZE: use a number with an optional K/M/G/T suffix"
    bs_bytes="$(to_bytes "$BS")" || usage_error "--bs $BS: use a number with an optional K/M/G/T suffix"
    ((bs_bytes > 0 && bs_bytes % 4096 == 0)) || usage_error "--bs $BS: O_DIRECT needs a positive multiple of 4096"
    [[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || usage_error "--jobs $JOBS: must be a positive integer"
    [[ "$IODEPTH" =~ ^[1-9][0-9]*$ ]] || usage_error "--iodepth $IODEPTH: must be a positive integer"
    case "$IOENGINE" in
        psync | libaio | io_uring) ;;
        *) usage_error "--ioengine $IOENGINE: use psync or libaio" ;;
    esac
    if ((${#DIRS[@]} == 0)); then
        mapfile -t DIRS < <(ms_default_offload_dirs)
    fi
}

cleanup() {
    local d
    if ((KEEP)); then
        ((${#WORK_DIRS[@]} == 0)) || log "test files kept in: ${WORK_DIRS[*]}"
        return 0
    fi
    for d in "${WORK_DIRS[@]}"; do
        rm -rf -- "$d"
    done
}

prepare_dirs() {
    local d free_kib need_kib work
    need_kib=$(($(to_bytes "$SIZE") * JOBS / 1024))
    for d in "${DIRS[@]}"; do
        [[ -d "$d" ]] || die "$d is not a directory"
        free_kib="$(df -Pk "$d" | awk 'NR == 2 { print $4 }')"
        ((free_kib > need_kib + 1024 * 1024)) ||
            die "$d has $((free_kib / 1024)) MiB free; $JOBS job(s) x $SIZE need $((need_kib / 1024)) MiB (+1 GiB margin): lower --size"
        work="$(mktemp -d "$d/.megatron_ssd_fio.XXXXXX")" || die "$d is not writable by $(id -un)"
        WORK_DIRS+=("$work")
    done
}

# run_fio RW DIR...: one fio run, every directory at once; prints "<KiB/s>".
run_fio() {
    local rw="$1" i out line bw
    shift
    # shellcheck disable=SC2016  # $jobnum is fio's, not the shell's
    local -a cmd=(fio --output-format=terse --terse-version=3 --group_reporting --thread
        --direct=1 --ioengine="$IOENGINE" --iodepth="$IODEPTH" --bs="$BS" --size="$SIZE"
        --rw="$rw" --numjobs="$JOBS" --filename_format='msfio.$jobnum')
    if [[ "$rw" == "write" ]]; then
        cmd+=(--end_fsync=1)
    fi
    for ((i = 1; i <= $#; i++)); do
        cmd+=(--name="megatron_ssd_${rw}_$i" --directory="${!i}")
    done
    printf '+ %s\n' "$(quote_cmd "${cmd[@]}")" >&2
    out="$(cd "$1" && "${cmd[@]}" 2>&1)" || die "fio failed:"$'\n'"$out"
    line="$(grep '^3;' <<<"$out" | head -n 1 || true)"
    [[ -n "$line" ]] || die "no result in fio's output:"$'\n'"$out"
    if [[ "$rw" == "write" ]]; then
        bw="$(cut -d';' -f48 <<<"$line")"
    else
        bw="$(cut -d';' -f7 <<<"$line")"
    fi
    [[ "$bw" =~ ^[0-9]+$ ]] || die "cannot read the bandwidth from fio's output: $line"
    printf '%s\n' "$bw"
}

mib_s() {
    awk -v kib="$1" 'BEGIN { printf "%.0f MiB/s (%.2f GB/s)", kib / 1024, kib * 1024 / 1e9 }'
}

main() {
    parse_args "$@"
    if ! command -v fio >/dev/null 2>&1; then
        explain_fio_install
        exit 3
    fi
    trap cleanup EXIT
    prepare_dirs
    log "profile: O_DIRECT, $IOENGINE (iodepth $IODEPTH), block $BS, $JOBS thread(s) per directory, $SIZE per thread, sequential write then read"
    local i w r
    local -a results=()
    for ((i = 0; i < ${#WORK_DIRS[@]}; i++)); do
        w="$(run_fio write "${WORK_DIRS[i]}")"
        r="$(run_fio read "${WORK_DIRS[i]}")"
        results+=("$(printf '%-40s write %s   read %s' "${DIRS[i]}" "$(mib_s "$w")" "$(mib_s "$r")")")
    done
    if ((AGGREGATE && ${#WORK_DIRS[@]} > 1)); then
        w="$(run_fio write "${WORK_DIRS[@]}")"
        r="$(run_fio read "${WORK_DIRS[@]}")"
        results+=("$(printf '%-40s write %s   read %s' "all ${#WORK_DIRS[@]} at once" "$(mib_s "$w")" "$(mib_s "$r")")")
    fi
    log "results:"
    printf '  %s\n' "${results[@]}"
}

main "$@"
