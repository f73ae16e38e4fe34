# shellcheck shell=bash
# Shared helpers of the megatron-ssd launch scripts (sourced, never executed).
#
# Usage (from another script in scripts/):
#   source "$SCRIPTS_DIR/common.sh"
#
# Everything here is a function or a read-only constant; sourcing has no side effects.
# Functions are prefixed with "ms_" and global state set by ms_configure_job is in
# upper-case variables documented in slurm_single_node.sbatch.

# ------------------------------------------------------------------------ logging

ms_log() {
    printf '[megatron-ssd] %s\n' "$*"
}

ms_warn() {
    printf '[megatron-ssd] WARNING: %s\n' "$*" >&2
}

ms_die() {
    printf '[megatron-ssd] ERROR: %s\n' "$*" >&2
    exit 1
}

ms_is_dry_run() {
    [[ "${DRY_RUN:-0}" == "1" ]]
}

# Print a command, shell-quoted, so that it can be copied and run as printed.
ms_quote_cmd() {
    local out="" arg q="'"
    for arg in "$@"; do
        if [[ "$arg" =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then
            out+="$arg "
        else
            out+="$q${arg//$q/$q\\$q$q}$q "
        fi
    done
    printf '%s\n' "${out% }"
}

# Print a command with a "+ " prefix, then run it unless DRY_RUN=1.
ms_run() {
    printf '+ %s\n' "$(ms_quote_cmd "$@")"
    if ms_is_dry_run; then
        return 0
    fi
    "$@"
}

# Print a command with a "+ " prefix, then replace the shell by it unless DRY_RUN=1.
ms_exec() {
    printf '+ %s\n' "$(ms_quote_cmd "$@")"
    if ms_is_dry_run; then
        exit 0
    fi
    exec "$@"
}

# The default offload directories of this node, one per line: for each mount in
# NVME_MOUNTS, its OFFLOAD_SUBDIR (default megatron-ssd) when that exists, else the mount.
ms_default_offload_dirs() {
    local -a mounts
    local m
    read -r -a mounts <<<"${NVME_MOUNTS:-/mnt/nvme_raid0}"
    for m in "${mounts[@]}"; do
        if [[ -d "$m/${OFFLOAD_SUBDIR:-megatron-ssd}" ]]; then
            printf '%s\n' "$m/${OFFLOAD_SUBDIR:-megatron-ssd}"
        else
            printf '%s\n' "$m"
        fi
    done
}

# ms_split_words NAME STRING: split STRING on whitespace into the array NAME.
# (No quote processing: values with spaces go into positional arguments instead.)
# shellcheck disable=SC2034  # assigns the caller's array through a nameref
ms_split_words() {
    local -n ms_split_words_out="$1"
    ms_split_words_out=()
    if [[ -n "${2:-}" ]]; then
        read -r -a ms_split_words_out <<<"$2"
    fi
}

ms_require_uint() {
    local name="$1" value="$2"
    if ! [[ "$value" =~ ^[0-9]+$ ]]; then
        ms_die "$name=$value: must be a non-negative integer"
    fi
}

# ------------------------------------------------------------------ SLURM helpers

# First host name of the job (the rendezvous host).
ms_first_host() {
    local nodelist="${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}"
    if [[ -z "$nodelist" ]]; then
        hostname
        return 0
    fi
    if command -v scontrol >/dev/null 2>&1; then
        scontrol show hostnames "$nodelist" | head -n 1
        return 0
    fi
    if [[ "$nodelist" != *\[* ]]; then
        printf '%s\n' "${nodelist%%,*}"
        return 0
    fi
    ms_warn "scontrol not found; cannot expand SLURM_JOB_NODELIST=$nodelist, using $(hostname) as MASTER_ADDR"
    hostname
}

# GPUs per node: GPUS_PER_NODE, else SLURM's view, else nvidia-smi, else 1.
ms_detect_gpus_per_node() {
    local n=""
    if [[ -n "${GPUS_PER_NODE:-}" ]]; then
        n="$GPUS_PER_NODE"
    elif [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
        n="$SLURM_GPUS_ON_NODE"
    elif [[ -n "${SLURM_GPUS_PER_NODE:-}" ]]; then
        n="${SLURM_GPUS_PER_NODE##*:}"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        n="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
    fi
    if [[ -z "$n" || "$n" == "0" ]]; then
        ms_warn "cannot tell how many GPUs this node has; set GPUS_PER_NODE (using 1)"
        n=1
    fi
    printf '%s\n' "$n"
}

# ------------------------------------------------------------ offload path layout

# ms_rank_paths_table GPUS SUBDIR MOUNT...: one line per local rank, holding that rank's
# offload directories joined by commas.
#   * one mount (a RAID0 array): every GPU gets MOUNT/SUBDIR/gpu<r>;
#   * fewer drives than GPUs: GPU r gets drive (r mod drives);
#   * at least as many drives as GPUs: GPU r gets every drive d with d mod GPUS == r,
#     and the engine stripes its blocks across them.
ms_rank_paths_table() {
    local gpus="$1" subdir="$2"
    shift 2
    local -a mounts=("$@")
    local n=${#mounts[@]} r d line
    for ((r = 0; r < gpus; r++)); do
        line=""
        if ((n >= gpus)); then
            for ((d = r; d < n; d += gpus)); do
                line+="${line:+,}${mounts[d]%/}/$subdir/gpu$r"
            done
        else
            line="${mounts[r % n]%/}/$subdir/gpu$r"
        fi
        printf '%s\n' "$line"
    done
}

# ms_mount_gpu_count GPUS MOUNT_INDEX MOUNT_COUNT: how many GPUs write to that mount.
ms_mount_gpu_count() {
    local gpus="$1" idx="$2" n="$3" r count=0
    for ((r = 0; r < gpus; r++)); do
        if ((n >= gpus)); then
            if ((idx % gpus == r)); then
                count=$((count + 1))
            fi
        elif ((r % n == idx)); then
            count=$((count + 1))
        fi
    done
    printf '%s\n' "$count"
}

ms_free_kib() {
    df -Pk "$1" | awk 'NR == 2 { print $4 }'
}

ms_fs_type() {
    stat -f -c %T "$1" 2>/dev/null || printf 'unknown\n'
}

# ms_check_mount MOUNT: exists, node-local, writable.
ms_check_mount() {
    local mount="$1" subdir="${OFFLOAD_SUBDIR}" fstype probe target
    [[ -e "$mount" ]] || ms_die "offload mount $mount does not exist on $(hostname) (NVME_MOUNTS=$NVME_MOUNTS)"
    [[ -d "$mount" ]] || ms_die "offload mount $mount is not a directory"
    fstype="$(ms_fs_type "$mount")"
    case "$fstype" in
        tmpfs | ramfs) ms_warn "$mount is on $fstype (memory, not SSD): offloading there saves no memory" ;;
        nfs* | lustre | gpfs | cifs | smb* | fuse* | ceph*)
            ms_warn "$mount is on $fstype, a network filesystem: offload directories should be node-local NVMe" ;;
    esac
    if [[ "$(stat -c %d "$mount")" == "$(stat -c %d /)" ]]; then
        ms_warn "$mount is on the root filesystem: is the NVMe drive mounted there?"
    fi
    target="$mount/$subdir"
    [[ -d "$target" ]] || target="$mount"
    probe="$(mktemp "$target/.megatron_ssd_probe.XXXXXX" 2>/dev/null)" ||
        ms_die "$target is not writable by $(id -un) on $(hostname) (create $mount/$subdir with mode 1777, see scripts/setup_nvme_raid0.sh)"
    rm -f "$probe"
    ms_log "  $mount: $fstype, writable"
}

# ms_check_free MOUNT GPUS_ON_IT: at least MIN_FREE_GB free for each GPU using it.
ms_check_free() {
    local mount="$1" users="$2" free_kib need_kib msg
    free_kib="$(ms_free_kib "$mount")"
    need_kib=$((MIN_FREE_GB * 1024 * 1024 * users))
    if ((free_kib < need_kib)); then
        msg="$mount has $((free_kib / 1024 / 1024)) GiB free, below MIN_FREE_GB=$MIN_FREE_GB x $users GPU(s)"
        if ms_is_dry_run; then
            ms_warn "$msg (a real run stops here unless cleaning frees space)"
            return 0
        fi
        ms_die "$msg"
    fi
    ms_log "  $mount: $((free_kib / 1024 / 1024)) GiB free for $users GPU(s)"
}

# Everything a node does before training: check the mounts, remove stale run
# directories, create the per-GPU directories, then check the free space.
ms_prepare_node() {
    local -a mounts rank_paths parts users=() dirs=() stale=()
    local i n d line
    ms_split_words mounts "$NVME_MOUNTS"
    n=${#mounts[@]}
    ms_log "node $(hostname): checking $n offload mount(s) for $GPUS_PER_NODE GPU(s)"
    for ((i = 0; i < n; i++)); do
        users[i]="$(ms_mount_gpu_count "$GPUS_PER_NODE" "$i" "$n")"
        if ((users[i] == 0)); then
            ms_warn "${mounts[i]}: no GPU uses it"
            continue
        fi
        ms_check_mount "${mounts[i]}"
    done
    if ((n > 1)); then
        local -A seen=()
        local dev
        for d in "${mounts[@]}"; do
            dev="$(stat -c %d "$d")"
            if [[ -n "${seen[$dev]:-}" ]]; then
                ms_warn "$d and ${seen[$dev]} are on the same filesystem: they share one drive's bandwidth"
            fi
            seen[$dev]="$d"
        done
    fi
    for d in "${mounts[@]}"; do
        for line in "${d%/}/$OFFLOAD_SUBDIR"/gpu*; do
            if [[ -d "$line" ]]; then
                stale+=("$line")
            fi
        done
    done
    if [[ "${SKIP_CLEAN:-0}" == "1" ]]; then
        ms_log "SKIP_CLEAN=1: not removing stale offload run directories"
    elif ((${#stale[@]} > 0)); then
        ms_log "cleaning offload run directories left by runs that died"
        ms_run "${MEGATRON_SSD_CMD[@]}" clean "${stale[@]}" ||
            ms_die "'${MEGATRON_SSD_CMD[*]} clean' failed on $(hostname)"
    fi
    mapfile -t rank_paths < <(ms_rank_paths_table "$GPUS_PER_NODE" "$OFFLOAD_SUBDIR" "${mounts[@]}")
    for line in "${rank_paths[@]}"; do
        IFS=',' read -r -a parts <<<"$line"
        dirs+=("${parts[@]}")
    done
    ms_run mkdir -p "${dirs[@]}"
    if ! ms_is_dry_run; then
        for line in "${dirs[@]}"; do
            [[ -w "$line" ]] || ms_die "$line is not writable by $(id -un)"
        done
    fi
    for ((i = 0; i < n; i++)); do
        if ((users[i] > 0)); then
            ms_check_free "${mounts[i]}" "${users[i]}"
        fi
    done
}

# --------------------------------------------------------------- job configuration

# Read the environment, fill in defaults and build the training command in the array
# TRAIN_CMD (without --ssd-offload-paths: the per-rank wrapper appends it).
# Arguments: extra Megatron-LM arguments (appended last).
ms_configure_job() {
    NNODES="${NNODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}}"
    GPUS_PER_NODE="$(ms_detect_gpus_per_node)"
    TP="${TP:-1}"
    PP="${PP:-1}"
    MICRO_BATCH="${MICRO_BATCH:-4}"
    GRAD_ACCUM="${GRAD_ACCUM:-$PP}"
    SEQ_LENGTH="${SEQ_LENGTH:-2048}"
    TRAIN_ITERS="${TRAIN_ITERS:-100}"
    MIN_FREE_GB="${MIN_FREE_GB:-50}"
    OFFLOAD_SUBDIR="${OFFLOAD_SUBDIR:-megatron-ssd}"
    NVME_MOUNTS="${NVME_MOUNTS:-/mnt/nvme_raid0}"
    LAUNCHER="${LAUNCHER:-torchrun}"
    CONFIG="${CONFIG:-}"
    local var
    for var in NNODES GPUS_PER_NODE TP PP MICRO_BATCH GRAD_ACCUM SEQ_LENGTH TRAIN_ITERS MIN_FREE_GB; do
        ms_require_uint "$var" "${!var}"
    done
    ((GPUS_PER_NODE > 0 && NNODES > 0 && TP > 0 && PP > 0)) || ms_die "NNODES, GPUS_PER_NODE, TP and PP must be positive"
    case "$LAUNCHER" in
        torchrun | srun) ;;
        *) ms_die "LAUNCHER=$LAUNCHER: must be torchrun or srun" ;;
    esac
    [[ "$OFFLOAD_SUBDIR" =~ ^[A-Za-z0-9._-]+$ ]] || ms_die "OFFLOAD_SUBDIR=$OFFLOAD_SUBDIR: use letters, digits, '.', '_' or '-'"

    local -a mounts
    ms_split_words mounts "$NVME_MOUNTS"
    ((${#mounts[@]} > 0)) || ms_die "NVME_MOUNTS is empty: give the NVMe mount points, e.g. NVME_MOUNTS=\"/mnt/nvme0 /mnt/nvme1\""
    for var in "${mounts[@]}"; do
        [[ "$var" == /* ]] || ms_die "NVME_MOUNTS entry $var: must be an absolute path"
        [[ "$var" != *,* ]] || ms_die "NVME_MOUNTS entry $var: must not contain a comma"
    done

    WORLD_SIZE_TOTAL=$((NNODES * GPUS_PER_NODE))
    if ((WORLD_SIZE_TOTAL % (TP * PP) != 0)); then
        ms_die "TP=$TP x PP=$PP does not divide $WORLD_SIZE_TOTAL GPUs ($NNODES node(s) x $GPUS_PER_NODE)"
    fi
    DP=$((WORLD_SIZE_TOTAL / (TP * PP)))
    GLOBAL_BATCH="${GLOBAL_BATCH:-$((MICRO_BATCH * DP * GRAD_ACCUM))}"
    ms_require_uint GLOBAL_BATCH "$GLOBAL_BATCH"
    if ((GLOBAL_BATCH % (MICRO_BATCH * DP) != 0)); then
        ms_die "GLOBAL_BATCH=$GLOBAL_BATCH must be a multiple of MICRO_BATCH x DP = $((MICRO_BATCH * DP))"
    fi

    MASTER_ADDR="${MASTER_ADDR:-$(ms_first_host)}"
    MASTER_PORT="${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-$$} % 20000))}"
    export MASTER_ADDR MASTER_PORT

    ms_split_words MEGATRON_SSD_CMD "${MEGATRON_SSD:-megatron-ssd}"
    ms_split_words TORCHRUN_CMD "${TORCHRUN:-torchrun}"
    local -a pretrain
    ms_split_words pretrain "${PRETRAIN_CMD:-${MEGATRON_SSD_CMD[*]} pretrain-gpt}"

    if [[ -z "${MEGATRON_LM_PATH:-}" ]]; then
        ms_die "MEGATRON_LM_PATH is not set: point it at a Megatron-LM checkout (the directory holding pretrain_gpt.py)"
    fi
    if [[ ! -f "$MEGATRON_LM_PATH/pretrain_gpt.py" ]]; then
        if ms_is_dry_run; then
            ms_warn "MEGATRON_LM_PATH=$MEGATRON_LM_PATH has no pretrain_gpt.py (a real run stops here)"
        else
            ms_die "MEGATRON_LM_PATH=$MEGATRON_LM_PATH has no pretrain_gpt.py"
        fi
    fi
    if ! command -v "${MEGATRON_SSD_CMD[0]}" >/dev/null 2>&1; then
        if ms_is_dry_run; then
            ms_warn "${MEGATRON_SSD_CMD[0]} not found on PATH (activate the environment holding megatron-ssd)"
        else
            ms_die "${MEGATRON_SSD_CMD[0]} not found on PATH (activate the environment holding megatron-ssd, or set MEGATRON_SSD)"
        fi
    fi
    if [[ -n "$CONFIG" && "$CONFIG" != /* ]]; then
        local base
        for base in "${SLURM_SUBMIT_DIR:-$PWD}" "$SCRIPTS_DIR/.."; do
            if [[ -f "$base/$CONFIG" ]]; then
                CONFIG="$(cd "$(dirname "$base/$CONFIG")" && pwd)/$(basename "$CONFIG")"
                break
            fi
        done
    fi
    if [[ -n "$CONFIG" && ! -f "$CONFIG" ]]; then
        ms_die "CONFIG=$CONFIG: no such offload preset (see configs/)"
    fi

    local -a model data tokenizer train extra overrides
    ms_split_words model "${MODEL_ARGS:---num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length $SEQ_LENGTH --max-position-embeddings $SEQ_LENGTH}"
    if [[ -n "${DATA_PATH:-}" ]]; then
        ms_split_words data "--data-path $DATA_PATH --split ${DATA_SPLIT:-949,50,1}"
        [[ -n "${TOKENIZER_ARGS:-}" ]] || ms_die "DATA_PATH is set but TOKENIZER_ARGS is not (e.g. TOKENIZER_ARGS=\"--tokenizer-type GPT2BPETokenizer --vocab-file V --merge-file M\")"
        ms_split_words tokenizer "$TOKENIZER_ARGS"
    else
        data=(--mock-data)
        ms_split_words tokenizer "${TOKENIZER_ARGS:---tokenizer-type NullTokenizer --vocab-size 32000}"
    fi
    ms_split_words train "${TRAIN_ARGS:---train-iters $TRAIN_ITERS --lr 1.0e-4 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.1 --clip-grad 1.0 --bf16 --log-interval 10 --eval-interval 1000 --eval-iters 10}"
    ms_split_words extra "${EXTRA_ARGS:-}"
    ms_split_words overrides "${OVERRIDES:-}"

    TRAIN_CMD=("${pretrain[@]}" --megatron-path "$MEGATRON_LM_PATH"
        --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
        --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
        "${model[@]}" "${data[@]}" "${tokenizer[@]}" "${train[@]}")
    if [[ -n "${CHECKPOINT_DIR:-}" ]]; then
        TRAIN_CMD+=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval "${SAVE_INTERVAL:-1000}")
    fi
    TRAIN_CMD+=("${extra[@]}" "$@" --ssd-offload)
    if [[ -n "$CONFIG" ]]; then
        TRAIN_CMD+=(--ssd-offload-config "$CONFIG")
    fi
    for var in "${overrides[@]}"; do
        [[ "$var" == *=* ]] || ms_die "OVERRIDES entry $var: must have the form key=value (e.g. io.threads=4)"
        TRAIN_CMD+=(--ssd-offload-override "$var")
    done

    mapfile -t RANK_PATHS < <(ms_rank_paths_table "$GPUS_PER_NODE" "$OFFLOAD_SUBDIR" "${mounts[@]}")
    MEGATRON_SSD_RANK_PATHS="${RANK_PATHS[*]}"
    export MEGATRON_SSD_RANK_PATHS NNODES GPUS_PER_NODE NVME_MOUNTS OFFLOAD_SUBDIR MIN_FREE_GB LAUNCHER
}

ms_print_plan() {
    local r
    ms_log "job ${SLURM_JOB_ID:-<no SLURM job>}: $NNODES node(s) x $GPUS_PER_NODE GPU(s), TP=$TP PP=$PP DP=$DP, micro-batch $MICRO_BATCH, global batch $GLOBAL_BATCH"
    if ((NNODES == 1)) && [[ "$LAUNCHER" == "torchrun" ]]; then
        ms_log "launcher: torchrun --standalone"
    else
        ms_log "launcher: $LAUNCHER, rendezvous $MASTER_ADDR:$MASTER_PORT"
    fi
    ms_log "Megatron-LM: $MEGATRON_LM_PATH"
    ms_log "offload preset: ${CONFIG:-<library defaults>}${OVERRIDES:+, overrides: $OVERRIDES}"
    ms_log "offload directories per local rank (same on every node):"
    for ((r = 0; r < ${#RANK_PATHS[@]}; r++)); do
        ms_log "  local rank $r -> ${RANK_PATHS[r]}"
    done
    if ms_is_dry_run; then
        ms_log "DRY_RUN=1: printing commands without running them"
    fi
}

# The exact command every local rank of this node will run, as the wrapper builds it.
ms_print_rank_commands() {
    local r
    ms_log "per-rank commands on each node (local rank r gets its own --ssd-offload-paths):"
    for ((r = 0; r < GPUS_PER_NODE; r++)); do
        LOCAL_RANK="$r" MS_RANK_EXEC_PRINT=1 bash "$SCRIPTS_DIR/ssd_rank_exec.sh" "${TRAIN_CMD[@]}" |
            sed "s/^/[megatron-ssd]   local rank $r: /"
    done
}

# The command that starts this node's GPU processes with torchrun.
ms_torchrun_cmd() {
    local -n ms_torchrun_out="$1"
    ms_torchrun_out=(env "MEGATRON_SSD_RANK_PATHS=$MEGATRON_SSD_RANK_PATHS" "${TORCHRUN_CMD[@]}")
    if ((NNODES == 1)); then
        ms_torchrun_out+=(--standalone --nnodes=1)
    else
        ms_torchrun_out+=(--nnodes="$NNODES" --rdzv-backend=c10d
            --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="${SLURM_JOB_ID:-megatron-ssd}")
    fi
    ms_torchrun_out+=(--nproc-per-node="$GPUS_PER_NODE" --max-restarts=0
        --no-python bash "$SCRIPTS_DIR/ssd_rank_exec.sh" "${TRAIN_CMD[@]}")
}

# srun steps get one CPU per task unless told otherwise; give the node's CPUs to them.
# shellcheck disable=SC2034  # assigns the caller's array through a nameref
ms_step_cpu_args() {
    local -n ms_step_cpu_out="$1"
    local tasks_per_node="$2" cpus="${CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-}}"
    ms_step_cpu_out=()
    if [[ "$cpus" =~ ^[0-9]+$ ]] && ((cpus >= tasks_per_node)); then
        ms_step_cpu_out=(--cpus-per-task="$((cpus / tasks_per_node))")
    fi
}

# The command that starts one task per GPU with srun (LAUNCHER=srun).
# shellcheck disable=SC2034  # assigns the caller's array through a nameref
ms_srun_tasks_cmd() {
    local -n ms_srun_out="$1"
    local -a cpu_args
    ms_step_cpu_args cpu_args "$GPUS_PER_NODE"
    ms_srun_out=(env "MEGATRON_SSD_RANK_PATHS=$MEGATRON_SSD_RANK_PATHS"
        srun --nodes="$NNODES" --ntasks="$WORLD_SIZE_TOTAL" --ntasks-per-node="$GPUS_PER_NODE"
        "${cpu_args[@]}" --kill-on-bad-exit=1 --export=ALL
        bash "$SCRIPTS_DIR/ssd_rank_exec.sh" "${TRAIN_CMD[@]}")
}

# The command that runs launch_node.sh once on every node of the job.
# shellcheck disable=SC2034  # assigns the caller's array through a nameref
ms_node_step_cmd() {
    local -n ms_node_step_out="$1"
    local -a cpu_args
    ms_step_cpu_args cpu_args 1
    ms_node_step_out=(srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1
        "${cpu_args[@]}" --kill-on-bad-exit=1 --export=ALL
        bash "$SCRIPTS_DIR/launch_node.sh")
}

# DRY_RUN preview of what launch_node.sh does on a node (run here, on this node).
ms_preview_node_step() {
    ms_log "---- each node runs (shown for $(hostname), DRY_RUN=1) ----"
    DRY_RUN=1 bash "$SCRIPTS_DIR/launch_node.sh" "$@"
    ms_log "---- end of node step ----"
}
