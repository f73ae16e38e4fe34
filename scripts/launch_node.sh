#!/bin/bash
# shellcheck shell=bash
# Per-node step of the SLURM scripts: check this node's NVMe offload mounts, remove
# stale offload run directories, create one directory per GPU, then (launch) start
# torchrun with one process per GPU and, when it ends, remove the emptied directories;
# (finish) only remove them. slurm_multi_node.sbatch runs it once per node:
#
#   srun --ntasks-per-node=1 bash scripts/launch_node.sh prepare
#   srun --ntasks-per-node=1 bash scripts/launch_node.sh launch megatron-ssd pretrain-gpt --megatron-path /opt/Megatron-LM ... --ssd-offload
#   srun --ntasks-per-node=1 bash scripts/launch_node.sh finish
#
# It reads the settings the batch script exported: NNODES, GPUS_PER_NODE, NVME_MOUNTS,
# MS_OFFLOAD_ROOTS, MS_ROOTS_ARE_MOUNTS, MS_JOB_DIR, OFFLOAD_SUBDIR, MIN_FREE_GB,
# MEGATRON_SSD_RANK_PATHS, MASTER_ADDR, MASTER_PORT, MEGATRON_SSD, TORCHRUN, SKIP_CLEAN,
# ALLOW_NON_MOUNT and DRY_RUN (see slurm_single_node.sbatch).
set -euo pipefail

usage() {
    awk 'NR == 1 { next } /^# shellcheck/ { next } /^#/ { sub(/^# ?/, ""); if (!started && $0 == "") next; started = 1; print; next } { exit }' "${BASH_SOURCE[0]}"
}

main() {
    local self_dir
    self_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
    SCRIPTS_DIR="$self_dir"
    # shellcheck source=common.sh
    source "$SCRIPTS_DIR/common.sh"

    local mode="${1:-}"
    case "$mode" in
        -h | --help)
            usage
            exit 0
            ;;
        prepare | launch | finish) shift ;;
        *)
            usage >&2
            exit 2
            ;;
    esac
    local var
    for var in NNODES GPUS_PER_NODE MS_OFFLOAD_ROOTS MS_JOB_DIR OFFLOAD_SUBDIR MIN_FREE_GB MEGATRON_SSD_RANK_PATHS MASTER_ADDR MASTER_PORT; do
        [[ -n "${!var:-}" ]] || ms_die "launch_node.sh: $var is not set (run it from the sbatch scripts)"
    done
    ms_split_words TORCHRUN_CMD "${TORCHRUN:-torchrun}"
    if [[ "$mode" == "finish" ]]; then
        ms_offload_dirs finish # NOTE [Job directories] in offload_dirs.py
        return 0
    fi
    ms_trap_job_signals # NOTE [Job signals]
    ms_offload_dirs prepare || exit
    if [[ "$mode" == "prepare" ]]; then
        return 0
    fi
    (($# > 0)) || ms_die "launch_node.sh launch: no training command given"
    # shellcheck disable=SC2034  # read by ms_torchrun_cmd (common.sh)
    TRAIN_CMD=("$@")
    local -a cmd
    local rc=0
    ms_torchrun_cmd cmd
    ms_log "node ${SLURMD_NODENAME:-$(hostname)}: starting $GPUS_PER_NODE GPU process(es)"
    ms_launch "${cmd[@]}" || rc=$?
    if ms_is_dry_run; then
        exit 0
    fi
    ms_offload_dirs finish || true
    exit "$rc"
}

main "$@"
