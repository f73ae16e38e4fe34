#!/bin/bash
# shellcheck shell=bash
# Per-process wrapper: gives each GPU process its own offload directories, then runs the
# training command. Started once per GPU by torchrun or srun, not by hand:
#
#   MEGATRON_SSD_RANK_PATHS="/mnt/nvme0/megatron-ssd/gpu0 /mnt/nvme1/megatron-ssd/gpu1" \
#     torchrun --standalone --nproc-per-node=2 --no-python \
#     bash scripts/ssd_rank_exec.sh megatron-ssd pretrain-gpt --megatron-path /opt/Megatron-LM ... --ssd-offload
#
#   MEGATRON_SSD_RANK_PATHS="..." srun --ntasks-per-node=2 bash scripts/ssd_rank_exec.sh COMMAND...
#
# The local rank comes from LOCAL_RANK (set by torchrun) or, under srun, from
# SLURM_LOCALID; under srun the wrapper also sets RANK, LOCAL_RANK, WORLD_SIZE and
# LOCAL_WORLD_SIZE from SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS and GPUS_PER_NODE
# (MASTER_ADDR and MASTER_PORT must already be exported). Entry number LOCAL_RANK of
# MEGATRON_SSD_RANK_PATHS (whitespace-separated; each entry is a comma-separated list of
# directories) is appended as "--ssd-offload-paths ENTRY" when the command has
# --ssd-offload (SSD_OFFLOAD=0 runs the same command without both).
#
#   MS_RANK_EXEC_PRINT=1 LOCAL_RANK=3 bash scripts/ssd_rank_exec.sh COMMAND...
# prints the command rank 3 would run instead of running it.
set -euo pipefail

usage() {
    awk 'NR == 1 { next } /^# shellcheck/ { next } /^#/ { sub(/^# ?/, ""); if (!started && $0 == "") next; started = 1; print; next } { exit }' "${BASH_SOURCE[0]}"
}

die() {
    printf '[megatron-ssd] ERROR (ssd_rank_exec.sh): %s\n' "$*" >&2
    exit 1
}

ms_here="${BASH_SOURCE[0]%/*}"
[[ "$ms_here" == "${BASH_SOURCE[0]}" ]] && ms_here=.
# shellcheck source=common.sh
source "$ms_here/common.sh"
quote_cmd() { ms_quote_cmd "$@"; }

map_slurm_task_env() {
    # srun started one task per GPU: translate SLURM's task ids to torch.distributed's.
    export RANK="${SLURM_PROCID:?SLURM_PROCID is not set}"
    export LOCAL_RANK="${SLURM_LOCALID:?SLURM_LOCALID is not set}"
    export WORLD_SIZE="${SLURM_NTASKS:?SLURM_NTASKS is not set}"
    export LOCAL_WORLD_SIZE="${GPUS_PER_NODE:-${SLURM_NTASKS_PER_NODE%%(*}}"
    : "${MASTER_ADDR:?MASTER_ADDR must be exported for srun-launched tasks}"
    : "${MASTER_PORT:?MASTER_PORT must be exported for srun-launched tasks}"
}

main() {
    if [[ $# -eq 0 ]]; then
        usage >&2
        exit 2
    fi
    case "$1" in
        -h | --help)
            usage
            exit 0
            ;;
    esac
    local arg
    for arg in "$@"; do
        [[ "$arg" != --ssd-offload-paths* ]] ||
            die "the command already has --ssd-offload-paths; this wrapper adds it per rank"
    done
    if [[ -z "${LOCAL_RANK:-}" ]]; then
        if [[ -n "${SLURM_LOCALID:-}" ]]; then
            map_slurm_task_env
        else
            die "neither LOCAL_RANK (torchrun) nor SLURM_LOCALID (srun) is set"
        fi
    fi
    [[ "$LOCAL_RANK" =~ ^[0-9]+$ ]] || die "LOCAL_RANK=$LOCAL_RANK is not a number"
    local -a table
    read -r -a table <<<"${MEGATRON_SSD_RANK_PATHS:-}"
    ((${#table[@]} > 0)) || die "MEGATRON_SSD_RANK_PATHS is empty (it lists the offload directories of each local rank)"
    if ((LOCAL_RANK >= ${#table[@]})); then
        die "local rank $LOCAL_RANK has no entry in MEGATRON_SSD_RANK_PATHS (${#table[@]} entries: more processes than GPUS_PER_NODE?)"
    fi
    local -a cmd=("$@")
    for arg in "$@"; do
        if [[ "$arg" == --ssd-offload ]]; then
            cmd+=(--ssd-offload-paths "${table[LOCAL_RANK]}")
            break
        fi
    done
    if [[ "${MS_RANK_EXEC_PRINT:-0}" == "1" ]]; then
        quote_cmd "${cmd[@]}"
        exit 0
    fi
    exec "${cmd[@]}"
}

main "$@"
