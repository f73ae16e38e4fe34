#!/bin/bash
# shellcheck shell=bash
# A stand-in for an N-drive NVMe array, for benchmarks (docs/ssd-sizing.md, "An array
# stand-in"): one loop device per drive over a file in tmpfs, formatted ext4 and mounted
# at DIR/drive0 ... DIR/drive<N-1>, each paced to a drive's sequential read and write
# rates by the kernel's block throttle in one cgroup (v1 blkio or v2 io.max, through
# python -m megatron_ssd_lab.blkio --create). `up` prints the offload.paths value
# (comma-separated) on stdout and everything else on stderr. Only processes in the cgroup
# are paced: start them with `exec`, which runs a command inside it.
#
#   scripts/array_standin.sh up N PRESET [--dir DIR] [--size SIZE] [--backing DIR]
#   scripts/array_standin.sh exec [--dir DIR] -- COMMAND...
#   scripts/array_standin.sh status [--dir DIR]
#   scripts/array_standin.sh down [--dir DIR]
#
#   paths=$(scripts/array_standin.sh up 4 micron-7450-pro-3.84tb)
#   scripts/array_standin.sh exec -- megatron-ssd train --config configs/gpt-gpu-check.yaml offload.paths="$paths"
#   scripts/array_standin.sh down
#
# Arguments:
#   N            drives, 1 to 16
#   PRESET       a drive preset of megatron_ssd/planner/drives.py (its sequential read and
#                write rates) or READ:WRITE, each drive's rates per second (50MiB:20MiB)
# Options:
#   --dir DIR      where the drives are mounted and the state file is kept (default
#                  /mnt/megatron-ssd-array); `up` creates it, or takes an empty directory
#   --size SIZE    each drive's capacity, at least 64MiB (default 2GiB); the backing files
#                  are sparse, so RAM is used only as bytes are written
#   --backing DIR  folder on tmpfs for the backing files (default /dev/shm)
#   -h, --help     this text
# Environment: PYTHON, an interpreter that imports megatron_ssd (default the repository's
# .venv/bin/python, else python3).
# Needs root, losetup, mkfs.ext4 and a cgroup-v1 blkio or cgroup-v2 io hierarchy. `up`
# records each thing it makes in DIR/array-standin.state before or as it makes it; `down`
# reads that file and acts only on what it lists: loop devices backed by the files `up`
# made, mounts of those devices at DIR/drive<i>, the cgroup, the backing files and the
# folders. It refuses a state file naming anything else, and leaves a loop device or mount
# that is not the one `up` made. A failed or interrupted `up` tears down what it made.
# What the stand-in does not model: NVMe sustained-write drop, mixed read/write
# interference, latency tails, wear, GPUDirect Storage; rates above what a loop device
# over tmpfs gives on the machine are capped there (status shows the limits).
# Exit status: 0 done, 1 failed (or refused), 2 usage error.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
STATE_NAME="array-standin.state"
STATE_MARK="# megatron-ssd array stand-in, state v1"
GROUP_PREFIX="megatron-ssd-array-"
BACKING_PREFIX="megatron-ssd-array."
MAX_DRIVES=16

ACTION=""
DRIVES=""
PRESET=""
DIR="/mnt/megatron-ssd-array"
SIZE="2GiB"
BACKING="/dev/shm"
COMMAND=()

usage() {
    awk 'NR == 1 { next } /^# shellcheck/ { next } /^#/ { sub(/^# ?/, ""); if (!started && $0 == "") next; started = 1; print; next } { exit }' "${BASH_SOURCE[0]}"
}

die_usage() {
    printf '[array_standin] ERROR: %s (see --help)\n' "$*" >&2
    exit 2
}

die() {
    printf '[array_standin] ERROR: %s\n' "$*" >&2
    exit 1
}

say() {
    printf '[array_standin] %s\n' "$*" >&2
}

parse_args() {
    local -a positional=()
    while (($# > 0)); do
        case "$1" in
            -h | --help)
                usage
                exit 0
                ;;
            --dir | --size | --backing)
                (($# >= 2)) || die_usage "$1 needs a value"
                case "$1" in
                    --dir) DIR="$2" ;;
                    --size) SIZE="$2" ;;
                    --backing) BACKING="$2" ;;
                esac
                shift
                ;;
            --)
                shift
                COMMAND=("$@")
                break
                ;;
            -*) die_usage "unknown option $1" ;;
            *) positional+=("$1") ;;
        esac
        shift
    done
    ((${#positional[@]} > 0)) || die_usage "give an action: up, exec, status or down"
    ACTION="${positional[0]}"
    case "$ACTION" in
        up)
            ((${#positional[@]} == 3)) || die_usage "up takes N and PRESET"
            DRIVES="${positional[1]}"
            PRESET="${positional[2]}"
            if [[ ! "$DRIVES" =~ ^[0-9]+$ ]] || ((10#$DRIVES < 1 || 10#$DRIVES > MAX_DRIVES)); then
                die_usage "N = $DRIVES: must be a whole number from 1 to $MAX_DRIVES"
            fi
            DRIVES=$((10#$DRIVES))
            ;;
        exec)
            ((${#positional[@]} == 1)) || die_usage "exec takes no arguments before -- COMMAND"
            ((${#COMMAND[@]} > 0)) || die_usage "exec needs -- COMMAND..."
            ;;
        status | down)
            ((${#positional[@]} == 1)) || die_usage "$ACTION takes no arguments"
            ;;
        *) die_usage "unknown action $ACTION: one of up, exec, status, down" ;;
    esac
    [[ "$ACTION" == exec || ${#COMMAND[@]} == 0 ]] || die_usage "only exec takes -- COMMAND"
    [[ "$DIR" != *[[:space:]]* ]] || die_usage "--dir $DIR: must not contain whitespace (/proc/mounts escapes it)"
    [[ "$DIR" == /* ]] || DIR="$PWD/$DIR"
    DIR="${DIR%/}"
    STATE="$DIR/$STATE_NAME"
}

pick_python() {
    if [[ -n "${PYTHON:-}" ]]; then
        PY="$PYTHON"
    elif [[ -x "$REPO/.venv/bin/python" ]]; then
        PY="$REPO/.venv/bin/python"
    else
        PY=python3
    fi
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
}

# inputs PRESET SIZE: prints "READ_BPS WRITE_BPS SIZE_BYTES" of a drive preset (or of
# READ:WRITE) and a size of at least 64MiB, or exits 1 with one line saying what is wrong,
# also when no cgroup throttle can be made here (one Python start: it imports torch).
inputs() {
    "$PY" - "$1" "$2" <<'EOF'
import sys
from megatron_ssd.errors import ConfigError
from megatron_ssd.io.pacing import parse_rate
from megatron_ssd_lab.blkio import throttle_available
from megatron_ssd.planner.drives import DRIVES, drive_preset
preset, size = sys.argv[1:3]
try:
    if preset in DRIVES or ":" not in preset:
        d = drive_preset(preset, "PRESET")
        rates = (int(d.read_bytes_per_s), int(d.write_bytes_per_s))
    else:
        rates = tuple(parse_rate("PRESET", side, text) for side, text in zip(("READ", "WRITE"), preset.split(":", 1)))
        if min(rates) <= 0:
            raise ConfigError(f"PRESET = {preset!r}: both rates must be > 0 bytes per second")
    nbytes = parse_rate("array_standin", "--size", size)
    if nbytes < 64 << 20:
        raise ConfigError(f"array_standin.--size = {size!r}: must be at least 64MiB (each drive holds an ext4 filesystem)")
    reason = throttle_available()
    if reason is not None:
        raise ConfigError(f"array_standin: {reason}")
except ConfigError as err:
    sys.exit(str(err))
print(*rates, nbytes)
EOF
}

record() {
    (
        IFS=$'\t'
        printf '%s\n' "$*"
    ) >>"$STATE"
}

# ------------------------------------------------------------------ the state file

# load_state: fills the arrays below from $STATE and refuses (exit 1, nothing done) a file
# that names anything `up` could not have made.
load_state() {
    local kind a b c first=1
    [[ -f "$STATE" ]] || die "no stand-in at $DIR (no $STATE); nothing done"
    S_DIR_MADE=0
    S_BACKING=""
    S_GROUP=""
    S_FILES=()
    S_MOUNTPOINTS=()
    S_READ=""
    S_WRITE=""
    S_PATHS=""
    while IFS=$'\t' read -r kind a b c; do
        if ((first)); then
            [[ "$kind" == "$STATE_MARK" ]] || die "$STATE: first line is not '$STATE_MARK'; not made by this script, nothing done"
            first=0
            continue
        fi
        case "$kind" in
            dir)
                [[ "$a" == "$DIR" ]] || refuse "dir $a is not $DIR"
                S_DIR_MADE=1
                ;;
            backing)
                [[ "$(basename "$a")" =~ ^${BACKING_PREFIX//./\\.}[A-Za-z0-9]{6,}$ && "$a" == /* ]] ||
                    refuse "backing folder $a is not one that up makes (${BACKING_PREFIX}XXXXXX)"
                S_BACKING="$a"
                ;;
            file)
                [[ -n "$S_BACKING" && "$(dirname "$a")" == "$S_BACKING" && "$(basename "$a")" =~ ^drive[0-9]+\.img$ ]] ||
                    refuse "file $a is not a drive<i>.img in the backing folder ${S_BACKING:-(none yet)}"
                S_FILES+=("$a")
                ;;
            mountpoint)
                [[ "$(dirname "$a")" == "$DIR" && "$(basename "$a")" =~ ^drive[0-9]+$ ]] ||
                    refuse "mount point $a is not $DIR/drive<i>"
                S_MOUNTPOINTS+=("$a")
                ;;
            cgroup)
                [[ "$(basename "$a")" == "$GROUP_PREFIX"* && "$a" == /sys/fs/cgroup/* && "$a" != *..* ]] ||
                    refuse "cgroup $a is not a ${GROUP_PREFIX}* group under /sys/fs/cgroup"
                S_GROUP="$a"
                ;;
            rates) S_READ="$a" S_WRITE="$b" ;;
            paths) S_PATHS="$a" ;;
            preset | drives | size | loop | ready) : ;;
            *) refuse "unknown record '$kind'" ;;
        esac
        : "$c"
    done <"$STATE"
}

refuse() {
    die "$STATE names $*; refusing to act on anything it lists (nothing done)"
}

# loops_of FILE: the loop devices backed by FILE.
loops_of() {
    losetup --noheadings --output NAME --associated "$1" 2>/dev/null || true
}

# ours_device DEV: whether DEV is a loop device backed by one of the recorded files.
ours_device() {
    local dev="$1" back f
    [[ "$dev" =~ ^/dev/loop[0-9]+$ ]] || return 1
    back="$(losetup --noheadings --output BACK-FILE "$dev" 2>/dev/null | sed 's/ *$//')" || return 1
    for f in "${S_FILES[@]}"; do
        [[ "$back" == "$f" ]] && return 0
    done
    return 1
}

# mount_source MOUNTPOINT: the device mounted there, empty when none.
mount_source() {
    awk -v m="$1" '$2 == m { src = $1 } END { print src }' /proc/mounts
}

group_procs() {
    [[ -n "$S_GROUP" && -f "$S_GROUP/cgroup.procs" ]] || return 0
    tr '\n' ' ' <"$S_GROUP/cgroup.procs" | sed 's/ *$//'
}

# ------------------------------------------------------------------ actions

teardown() {
    local procs m src f dev failed=0
    procs="$(group_procs)"
    if [[ -n "$procs" ]]; then
        die "processes $procs are still in $S_GROUP: end them (or move them out) and run down again; nothing done"
    fi
    for m in "${S_MOUNTPOINTS[@]}"; do
        src="$(mount_source "$m")"
        [[ -n "$src" ]] || continue
        if ours_device "$src"; then
            umount "$m" || failed=1
        else
            say "left alone: $m is a mount of $src, not of a loop device over this stand-in's files"
            failed=1
        fi
    done
    for f in "${S_FILES[@]}"; do
        for dev in $(loops_of "$f"); do
            losetup --detach "$dev" || failed=1
        done
    done
    ((failed == 0)) || die "some mounts or loop devices could not be removed (above); the state file $STATE stays"
    for f in "${S_FILES[@]}"; do
        rm -f -- "$f"
    done
    [[ -z "$S_BACKING" || ! -d "$S_BACKING" ]] || rmdir -- "$S_BACKING"
    for m in "${S_MOUNTPOINTS[@]}"; do
        [[ ! -d "$m" ]] || rmdir -- "$m" || failed=1
    done
    [[ -z "$S_GROUP" || ! -d "$S_GROUP" ]] || rmdir -- "$S_GROUP" || failed=1
    ((failed == 0)) || die "some folders could not be removed (above); the state file $STATE stays"
    rm -f -- "$STATE"
    if ((S_DIR_MADE)); then
        rmdir -- "$DIR" 2>/dev/null || say "left $DIR: not empty"
    fi
}

do_down() {
    load_state
    teardown
    say "down: $DIR torn down"
}

UP_DONE=0
up_cleanup() {
    local rc=$?
    ((UP_DONE)) && return 0
    trap - EXIT INT TERM
    if [[ -f "$STATE" ]]; then
        say "up did not finish: tearing down what it made"
        (
            load_state
            teardown
        ) || say "teardown after the failed up failed too; see above and $STATE"
    fi
    exit $((rc == 0 ? 1 : rc))
}

do_up() {
    local rbps wbps bytes i img dev mnt group backing paths="" ptype made_dir=0
    local -a throttle_paths=()
    [[ "$(id -u)" == 0 ]] || die "up needs root (loop devices, mounts, cgroups); running as uid $(id -u)"
    command -v losetup >/dev/null || die "losetup is not installed (util-linux)"
    command -v mkfs.ext4 >/dev/null || die "mkfs.ext4 is not installed (e2fsprogs)"
    [[ -d "$BACKING" ]] || die "--backing $BACKING: not a directory"
    ptype="$(stat -f -c %T "$BACKING")"
    [[ "$ptype" == tmpfs ]] || die "--backing $BACKING is on $ptype, not tmpfs: the drives must be RAM-backed"
    if [[ -e "$DIR" ]]; then
        [[ -d "$DIR" ]] || die "--dir $DIR exists and is not a directory"
        [[ -z "$(ls -A "$DIR")" ]] || die "--dir $DIR is not empty (a stand-in is up there, or other files): use another"
    fi
    read -r rbps wbps bytes < <(inputs "$PRESET" "$SIZE") || true
    [[ -n "${bytes:-}" ]] || die "nothing made (the line above says why)"

    trap up_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    if [[ ! -d "$DIR" ]]; then
        mkdir -p -- "$DIR"
        made_dir=1
    fi
    printf '%s\n' "$STATE_MARK" >"$STATE"
    ((made_dir == 0)) || record dir "$DIR"
    record preset "$PRESET"
    record drives "$DRIVES"
    record size "$bytes"
    record rates "$rbps" "$wbps"
    backing="$(mktemp -d "${BACKING%/}/${BACKING_PREFIX}XXXXXXXX")"
    record backing "$backing"
    for ((i = 0; i < DRIVES; i++)); do
        img="$backing/drive$i.img"
        mnt="$DIR/drive$i"
        record file "$img"
        truncate -s "$bytes" "$img"
        dev="$(losetup --find --show "$img")"
        record loop "$dev" "$img"
        mkfs.ext4 -q -F -b 4096 -m 0 -E nodiscard,lazy_itable_init=0,lazy_journal_init=0 "$dev" >&2
        record mountpoint "$mnt"
        mkdir -- "$mnt"
        mount -o noatime "$dev" "$mnt"
        throttle_paths+=(--path "$mnt")
        paths+="${paths:+,}$mnt"
    done
    group="$GROUP_PREFIX${backing##*/"$BACKING_PREFIX"}"
    group="$("$PY" -m megatron_ssd_lab.blkio "${throttle_paths[@]}" --read "$rbps" --write "$wbps" \
        --create "$group")"
    record cgroup "$group"
    record paths "$paths"
    record ready
    UP_DONE=1
    trap - EXIT INT TERM
    say "up: $DRIVES drives of $PRESET (read $rbps B/s, write $wbps B/s each), $SIZE each, in $DIR"
    say "paced only inside the cgroup $group: scripts/array_standin.sh exec --dir $DIR -- COMMAND..."
    say "  (or move a shell in: echo \$\$ > $group/cgroup.procs)"
    say "offload.paths (on stdout):"
    printf '%s\n' "$paths"
}

do_exec() {
    load_state
    [[ -n "$S_GROUP" && -d "$S_GROUP" ]] || die "the stand-in at $DIR has no cgroup (up did not finish?)"
    printf '%s\n' "$BASHPID" >"$S_GROUP/cgroup.procs"
    exec "${COMMAND[@]}"
}

do_status() {
    local m src procs
    load_state
    say "stand-in at $DIR: offload.paths=$S_PATHS"
    say "per drive: read ${S_READ:-?} B/s, write ${S_WRITE:-?} B/s; backing files in ${S_BACKING:-?}"
    for m in "${S_MOUNTPOINTS[@]}"; do
        src="$(mount_source "$m")"
        say "  $m: ${src:-not mounted}"
    done
    if [[ -n "$S_GROUP" && -d "$S_GROUP" ]]; then
        procs="$(group_procs)"
        say "cgroup $S_GROUP (processes: ${procs:-none}); limits as the kernel reports them:"
        if [[ -f "$S_GROUP/io.max" ]]; then
            sed 's/^/  io.max: /' "$S_GROUP/io.max" >&2
        else
            sed 's/^/  read: /' "$S_GROUP/blkio.throttle.read_bps_device" >&2
            sed 's/^/  write: /' "$S_GROUP/blkio.throttle.write_bps_device" >&2
        fi
    else
        say "no cgroup"
    fi
    printf '%s\n' "$S_PATHS"
}

main() {
    parse_args "$@"
    pick_python
    case "$ACTION" in
        up) do_up ;;
        exec) do_exec ;;
        status) do_status ;;
        down) do_down ;;
    esac
}

main "$@"
