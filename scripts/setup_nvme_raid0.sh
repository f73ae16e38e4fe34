#!/bin/bash
# shellcheck shell=bash
# Build an NVMe RAID0 array for megatron-ssd activation offload: mdadm RAID0 over the
# given drives, an XFS (or ext4) filesystem aligned to the stripe with 4096-byte sectors
# for O_DIRECT, mounted with noatime, and an offload directory on it.
#
#   sudo scripts/setup_nvme_raid0.sh [OPTIONS] /dev/nvme0n1 /dev/nvme1n1 ...
#   scripts/setup_nvme_raid0.sh --dry-run /dev/nvme0n1 /dev/nvme1n1   # print only
#
# Options:
#   --md DEVICE          md device to create (default /dev/md0)
#   --name NAME          array name and filesystem label (default megatron_ssd)
#   --mount DIR          mount point (default /mnt/nvme_raid0)
#   --fs xfs|ext4        filesystem (default xfs)
#   --chunk KIB          RAID0 chunk size in KiB, a power of two >= 4 (default 512)
#   --offload-dir NAME   directory created on the filesystem (default megatron-ssd)
#   --owner USER[:GROUP] give the offload directory to USER (mode 0750) instead of
#                        leaving it world-writable with the sticky bit (mode 1777)
#   --persist            add the array to mdadm.conf and the mount to /etc/fstab (nofail)
#   --force              wipe existing filesystem / RAID signatures on the drives (wipefs -a);
#                        never overrides the other checks
#   --dry-run            check the drives, print every command, change nothing (no root needed)
#   -h, --help           this text
#
# With one drive no array is built: the drive is formatted and mounted directly.
# Refused, whatever the options: a path that is not a block device, a drive that is
# mounted or used as swap, a drive held by an md array / LVM / device-mapper, a drive
# with partitions, the same drive twice. Refused unless --force: a drive carrying a
# filesystem, RAID or partition-table signature (blkid / wipefs -n).
#
# Exit status: 0 done (or dry run printed), 1 refused or failed, 2 bad usage.
set -euo pipefail

MD_DEVICE="/dev/md0"
ARRAY_NAME="megatron_ssd"
MOUNT_POINT="/mnt/nvme_raid0"
FS_TYPE="xfs"
CHUNK_KIB=512
OFFLOAD_DIR="megatron-ssd"
OWNER=""
PERSIST=0
FORCE=0
DRY_RUN=0
DEVICES=()

usage() {
    awk 'NR == 1 { next } /^# shellcheck/ { next } /^#/ { sub(/^# ?/, ""); if (!started && $0 == "") next; started = 1; print; next } { exit }' "${BASH_SOURCE[0]}"
}

log() {
    printf '[setup_nvme_raid0] %s\n' "$*"
}

die() {
    printf '[setup_nvme_raid0] ERROR: %s\n' "$*" >&2
    exit 1
}

usage_error() {
    printf '[setup_nvme_raid0] ERROR: %s (see --help)\n' "$*" >&2
    exit 2
}

ms_here="${BASH_SOURCE[0]%/*}"
[[ "$ms_here" == "${BASH_SOURCE[0]}" ]] && ms_here=.
# shellcheck source=common.sh
source "$ms_here/common.sh"
quote_cmd() { ms_quote_cmd "$@"; }

# Print a command; run it unless --dry-run.
run() {
    printf '+ %s\n' "$(quote_cmd "$@")"
    if ((DRY_RUN)); then
        return 0
    fi
    "$@"
}

# append_line FILE LINE: add LINE to FILE unless already there.
append_line() {
    local file="$1" line="$2"
    printf '+ %s >> %s\n' "$(quote_cmd echo "$line")" "$file"
    if ((DRY_RUN)); then
        return 0
    fi
    if [[ -f "$file" ]] && grep -qxF -- "$line" "$file"; then
        log "$file already has: $line"
        return 0
    fi
    printf '%s\n' "$line" >>"$file"
}

parse_args() {
    while (($# > 0)); do
        case "$1" in
            -h | --help)
                usage
                exit 0
                ;;
            --dry-run) DRY_RUN=1 ;;
            --force) FORCE=1 ;;
            --persist) PERSIST=1 ;;
            --md | --name | --mount | --fs | --chunk | --offload-dir | --owner)
                (($# >= 2)) || usage_error "$1 needs a value"
                case "$1" in
                    --md) MD_DEVICE="$2" ;;
                    --name) ARRAY_NAME="$2" ;;
                    --mount) MOUNT_POINT="$2" ;;
                    --fs) FS_TYPE="$2" ;;
                    --chunk) CHUNK_KIB="$2" ;;
                    --offload-dir) OFFLOAD_DIR="$2" ;;
                    --owner) OWNER="$2" ;;
                esac
                shift
                ;;
            --)
                shift
                DEVICES+=("$@")
                break
                ;;
            -*) usage_error "unknown option $1" ;;
            *) DEVICES+=("$1") ;;
        esac
        shift
    done
    ((${#DEVICES[@]} > 0)) || usage_error "no NVMe devices given"
    case "$FS_TYPE" in
        xfs | ext4) ;;
        *) usage_error "--fs $FS_TYPE: must be xfs or ext4" ;;
    esac
    if ! [[ "$CHUNK_KIB" =~ ^[0-9]+$ ]] || ((CHUNK_KIB < 4 || (CHUNK_KIB & (CHUNK_KIB - 1)) != 0)); then
        usage_error "--chunk $CHUNK_KIB: must be a power of two >= 4 (KiB)"
    fi
    [[ "$MOUNT_POINT" == /* && "$MOUNT_POINT" != *[[:space:]]* ]] ||
        usage_error "--mount $MOUNT_POINT: must be an absolute path without spaces"
    [[ "$OFFLOAD_DIR" =~ ^[A-Za-z0-9._-]+$ && "$OFFLOAD_DIR" != "." && "$OFFLOAD_DIR" != ".." ]] ||
        usage_error "--offload-dir $OFFLOAD_DIR: one directory name (letters, digits, '.', '_', '-')"
    [[ "$ARRAY_NAME" =~ ^[A-Za-z0-9_-]{1,12}$ ]] ||
        usage_error "--name $ARRAY_NAME: 1-12 letters, digits, '_' or '-' (it is also the filesystem label)"
}

require_tools() {
    local -a tools=(blkid wipefs lsblk mount mkdir)
    local t missing=()
    if ((${#DEVICES[@]} > 1)); then
        tools+=(mdadm)
    fi
    if [[ "$FS_TYPE" == "xfs" ]]; then
        tools+=(mkfs.xfs)
    else
        tools+=(mkfs.ext4)
    fi
    for t in "${tools[@]}"; do
        command -v "$t" >/dev/null 2>&1 || missing+=("$t")
    done
    if ((${#missing[@]} > 0)); then
        local msg="missing tools: ${missing[*]} (Debian/Ubuntu: apt-get install mdadm xfsprogs e2fsprogs util-linux; RHEL: dnf install mdadm xfsprogs e2fsprogs util-linux)"
        if ((DRY_RUN)); then
            printf '[setup_nvme_raid0] WARNING: %s\n' "$msg" >&2
        else
            die "$msg"
        fi
    fi
}

# Every check that cannot be overridden, then the signature check (--force).
check_device() {
    local dev="$1" real name mnt holders sig
    [[ -e "$dev" ]] || die "$dev does not exist"
    real="$(readlink -f -- "$dev")"
    [[ -b "$real" ]] || die "$dev is not a block device; give whole NVMe drives such as /dev/nvme0n1"
    if [[ " ${CHECKED[*]} " == *" $real "* ]]; then
        die "$dev is given twice (it is $real)"
    fi
    name="$(basename "$real")"
    if [[ -e "/sys/class/block/$name/partition" ]]; then
        die "$dev is a partition; give whole drives (e.g. /dev/nvme0n1), not partitions"
    fi
    mnt="$(lsblk -nro MOUNTPOINT "$real" 2>/dev/null | grep -v '^$' || true)"
    if [[ -n "$mnt" ]]; then
        die "$dev (or one of its partitions) is mounted on: $(tr '\n' ' ' <<<"$mnt")-- refusing, even with --force"
    fi
    if grep -q "^${real}[[:space:]]" /proc/swaps 2>/dev/null; then
        die "$dev is in use as swap"
    fi
    if grep -qw "$name" /proc/mdstat 2>/dev/null; then
        die "$dev is part of an existing md array (see /proc/mdstat); stop and remove that array first"
    fi
    holders="$(ls -A "/sys/class/block/$name/holders" 2>/dev/null || true)"
    if [[ -n "$holders" ]]; then
        die "$dev is held by $(tr '\n' ' ' <<<"$holders")(md, LVM or device-mapper); release it first"
    fi
    if compgen -G "/sys/class/block/$name/${name}*/partition" >/dev/null ||
        [[ "$(lsblk -nro TYPE "$real" 2>/dev/null | grep -c '^part$' || true)" != "0" ]]; then
        die "$dev has partitions; remove them first (check its contents, then: wipefs -a ${real}p* $real)"
    fi
    [[ "$name" == nvme* ]] || printf '[setup_nvme_raid0] WARNING: %s is not an NVMe device\n' "$dev" >&2
    if [[ ! -r "$real" ]]; then
        if ((DRY_RUN)); then
            printf '[setup_nvme_raid0] WARNING: cannot read %s as %s: signatures not checked (run as root)\n' "$dev" "$(id -un)" >&2
            CHECKED+=("$real")
            return 0
        fi
        die "cannot read $dev"
    fi
    sig="$(
        blkid -p -o export "$real" 2>/dev/null | grep -E '^(TYPE|PTTYPE)=' || true
        wipefs -n "$real" 2>/dev/null | awk 'NR > 1 { print $3 " at offset " $2 }' || true
    )"
    if [[ -n "$sig" ]]; then
        if ((FORCE)); then
            printf '[setup_nvme_raid0] WARNING: %s carries signatures (%s); --force: they will be wiped\n' "$dev" "$(tr '\n' ' ' <<<"$sig")" >&2
            WIPE+=("$real")
        else
            die "$dev carries a filesystem / RAID / partition-table signature: $(tr '\n' ' ' <<<"$sig")-- it may hold data. Check it, then re-run with --force to wipe it"
        fi
    fi
    CHECKED+=("$real")
}

check_devices() {
    local dev
    CHECKED=()
    WIPE=()
    for dev in "${DEVICES[@]}"; do
        check_device "$dev"
    done
    if ((${#DEVICES[@]} > 1)) && [[ -e "$MD_DEVICE" ]]; then
        die "$MD_DEVICE already exists; choose another with --md"
    fi
    if mountpoint -q "$MOUNT_POINT" 2>/dev/null; then
        die "$MOUNT_POINT is already a mount point; choose another with --mount"
    fi
    if [[ -d "$MOUNT_POINT" && -n "$(ls -A "$MOUNT_POINT" 2>/dev/null)" ]]; then
        die "$MOUNT_POINT is not empty; choose another with --mount"
    fi
}

create_filesystem() {
    local target="$1" ndev="$2"
    local stride=$((CHUNK_KIB / 4))
    if [[ "$FS_TYPE" == "xfs" ]]; then
        if ((ndev > 1)); then
            run mkfs.xfs -f -L "$ARRAY_NAME" -s size=4096 -d "su=${CHUNK_KIB}k,sw=${ndev}" "$target"
        else
            run mkfs.xfs -f -L "$ARRAY_NAME" -s size=4096 "$target"
        fi
    else
        if ((ndev > 1)); then
            run mkfs.ext4 -F -L "$ARRAY_NAME" -b 4096 -m 0 -E "stride=${stride},stripe_width=$((stride * ndev))" "$target"
        else
            run mkfs.ext4 -F -L "$ARRAY_NAME" -b 4096 -m 0 "$target"
        fi
    fi
}

persist() {
    local target="$1" uuid conf
    if ((${#CHECKED[@]} > 1)); then
        conf="/etc/mdadm/mdadm.conf"
        [[ -d /etc/mdadm ]] || conf="/etc/mdadm.conf"
        if ((DRY_RUN)); then
            printf '+ mdadm --detail --scan %s >> %s\n' "$(quote_cmd "$MD_DEVICE")" "$conf"
        else
            mdadm --detail --scan "$MD_DEVICE" >>"$conf"
        fi
        log "on Debian/Ubuntu also run: update-initramfs -u (RHEL: dracut -f) so the array assembles at boot"
    fi
    if ((DRY_RUN)); then
        uuid="<UUID of $target>"
    else
        uuid="$(blkid -s UUID -o value "$target")"
    fi
    append_line /etc/fstab "UUID=$uuid $MOUNT_POINT $FS_TYPE noatime,nofail 0 0"
}

main() {
    parse_args "$@"
    if ((!DRY_RUN)) && [[ "$(id -u)" != "0" ]]; then
        die "must run as root (or use --dry-run to see the commands)"
    fi
    require_tools
    check_devices
    local target ndev=${#CHECKED[@]}
    log "drives: ${CHECKED[*]} ($ndev); filesystem $FS_TYPE on $MOUNT_POINT; offload directory $MOUNT_POINT/$OFFLOAD_DIR"
    if ((DRY_RUN)); then
        log "--dry-run: printing the commands, running none"
    fi

    local dev
    for dev in "${WIPE[@]}"; do
        run wipefs -a "$dev"
    done
    if ((ndev > 1)); then
        target="$MD_DEVICE"
        run mdadm --create "$MD_DEVICE" --run --level=0 --metadata=1.2 --chunk="$CHUNK_KIB" \
            --name="$ARRAY_NAME" --raid-devices="$ndev" "${CHECKED[@]}"
        if command -v udevadm >/dev/null 2>&1; then
            run udevadm settle
        fi
    else
        target="${CHECKED[0]}"
        log "one drive: no RAID array, formatting $target directly"
    fi
    create_filesystem "$target" "$ndev"
    run mkdir -p "$MOUNT_POINT"
    run mount -o noatime "$target" "$MOUNT_POINT"
    run mkdir -p "$MOUNT_POINT/$OFFLOAD_DIR"
    if [[ -n "$OWNER" ]]; then
        run chown "$OWNER" "$MOUNT_POINT/$OFFLOAD_DIR"
        run chmod 0750 "$MOUNT_POINT/$OFFLOAD_DIR"
    else
        run chmod 1777 "$MOUNT_POINT/$OFFLOAD_DIR"
    fi
    if ((PERSIST)); then
        persist "$target"
    fi
    log "done: use NVME_MOUNTS=$MOUNT_POINT with the sbatch scripts; check the bandwidth with: scripts/bench_io.sh $MOUNT_POINT/$OFFLOAD_DIR"
}

main "$@"
