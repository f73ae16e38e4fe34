# shellcheck shell=bash
# Shared wiring of the megatron-ssd launch scripts (sourced, never executed): settings from
# the environment, the launch commands, and the shell's signal handling. What needs tests
# lives in scripts/offload_dirs.py (each rank's directories, the checks, the start-up clean).
#
# Usage (from another script in scripts/):
#   source "$SCRIPTS_DIR/common.sh"
#
# Everything here is a function; sourcing has no side effects. Functions are prefixed with
# "ms_"; the settings ms_configure_job fills in are the upper-case variables documented in
# slurm_single_node.sbatch.

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

# ------------------------------------------------------------- offload directories

# ms_offload_dirs paths|prepare|finish: scripts/offload_dirs.py with this job's settings
# (exported by ms_configure_job). paths: each local rank's directories, one line per rank;
# prepare: check this node's roots, the start-up clean, check the free space, create the
# directories; finish: remove the directories the job left empty (NOTE [Job directories]
# there). A refusal is its one ERROR line and exit status 1.
ms_offload_dirs() {
    python3 "$SCRIPTS_DIR/offload_dirs.py" "$@"
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
    NVME_MOUNTS="${NVME_MOUNTS:-}"
    LAUNCHER="${LAUNCHER:-torchrun}"
    SSD_OFFLOAD="${SSD_OFFLOAD:-1}"
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
    [[ "$SSD_OFFLOAD" == 0 || "$SSD_OFFLOAD" == 1 ]] || ms_die "SSD_OFFLOAD=$SSD_OFFLOAD: must be 1 (offload) or 0 (the same job without --ssd-offload)"

    # The offload roots: the NVMe mounts, or without them the node-local scratch directory
    # the site gives jobs; this job's directory under each (NOTE [Job directories] in
    # offload_dirs.py).
    local -a mounts
    if [[ -n "${NVME_MOUNTS//[[:space:]]/}" ]]; then
        MS_ROOTS_ARE_MOUNTS=1
        ms_split_words mounts "$NVME_MOUNTS"
    else
        MS_ROOTS_ARE_MOUNTS=0
        mounts=("${SLURM_TMPDIR:-${TMPDIR:-/tmp}}")
    fi
    for var in "${mounts[@]}"; do
        [[ "$var" == /* ]] || ms_die "NVME_MOUNTS entry $var: must be an absolute path"
        [[ "$var" != *,* ]] || ms_die "NVME_MOUNTS entry $var: must not contain a comma"
    done
    MS_OFFLOAD_ROOTS="${mounts[*]}"
    MS_JOB_DIR="job${SLURM_JOB_ID:-}"
    [[ -n "${SLURM_JOB_ID:-}" ]] || MS_JOB_DIR="pid$$"

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
    # 20000-29999: below Linux's default ephemeral range (32768-60999), where a port may be
    # held by one of the node's own outgoing connections
    MASTER_PORT="${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-$$} % 10000))}"
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
        # Megatron's own handler: SIGTERM (scancel, or USR1 turned into SIGTERM, NOTE [Job
        # signals]) saves a checkpoint at the end of the iteration, then exits.
        TRAIN_CMD+=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval "${SAVE_INTERVAL:-1000}"
            --exit-signal-handler)
    fi
    TRAIN_CMD+=("${extra[@]}" "$@")
    if [[ "$SSD_OFFLOAD" == 1 ]]; then
        # The ranks remove their emptied gpu<r> and job<id> directories themselves (NOTE
        # [Job directories] in offload_dirs.py); OVERRIDES come after, so a user's value wins.
        TRAIN_CMD+=(--ssd-offload --ssd-offload-override remove_empty_parents=2)
        if [[ -n "$CONFIG" ]]; then
            TRAIN_CMD+=(--ssd-offload-config "$CONFIG")
        fi
        for var in "${overrides[@]}"; do
            [[ "$var" == *=* ]] || ms_die "OVERRIDES entry $var: must have the form key=value (e.g. io.threads=4)"
            TRAIN_CMD+=(--ssd-offload-override "$var")
        done
    fi

    export NNODES GPUS_PER_NODE NVME_MOUNTS OFFLOAD_SUBDIR MIN_FREE_GB LAUNCHER
    export MS_OFFLOAD_ROOTS MS_ROOTS_ARE_MOUNTS MS_JOB_DIR
    command -v python3 >/dev/null 2>&1 || ms_die "python3 not found on PATH (the launch scripts run scripts/offload_dirs.py with it)"
    local table
    table="$(ms_offload_dirs paths)" || exit
    mapfile -t RANK_PATHS <<<"$table"
    MEGATRON_SSD_RANK_PATHS="${RANK_PATHS[*]}"
    export MEGATRON_SSD_RANK_PATHS
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
    if [[ "$SSD_OFFLOAD" == 1 ]]; then
        ms_log "offload preset: ${CONFIG:-<library defaults>}${OVERRIDES:+, overrides: $OVERRIDES}"
    else
        ms_log "SSD_OFFLOAD=0: the same job without --ssd-offload"
    fi
    if [[ "$MS_ROOTS_ARE_MOUNTS" == 0 ]]; then
        ms_log "NVME_MOUNTS is unset: offloading to the node-local scratch directory $MS_OFFLOAD_ROOTS (SLURM_TMPDIR, else TMPDIR, else /tmp)"
    fi
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


# ----------------------------------------------------------------- job signals

# NOTE [Job signals]
# The launching shells (the batch script, launch_node.sh) run the launcher as a child and
# wait for it, instead of exec'ing it, so that they can act on signals and tidy up after:
#   * SIGTERM / SIGINT (scancel, a time limit, Ctrl-C): under SLURM every process of the
#     job gets the signal from SLURM itself, so the shell only notes it and waits; the
#     ranks delete their run directories (with CHECKPOINT_DIR, after Megatron's
#     --exit-signal-handler saved a checkpoint). Outside SLURM the shell passes the signal
#     on to its child. SIGKILL leaves run directories for the next start-up clean.
#   * SIGUSR1 (sbatch --signal=B:USR1@SECONDS, to the batch shell only): the shell has the
#     ranks sent SIGTERM, which stops them as above, then requeues the job (scontrol
#     requeue). A torchrun child gets the SIGTERM and passes it on; an srun child must not
#     (srun takes SIGTERM as "kill the step": SIGKILL to its tasks), so then `scancel
#     --signal=TERM JOBID` signals the job's steps instead.
# The child starts with SIGINT and SIGQUIT at their defaults: bash would otherwise give a
# background command SIGINT ignored, and Python would then never see Ctrl-C.
MS_CHILD=""
MS_CHILD_IS_SRUN=0
MS_STOP_SIGNAL=""

ms_on_signal() {
    local sig="$1"
    [[ -n "$MS_STOP_SIGNAL" ]] || MS_STOP_SIGNAL="$sig"
    if [[ "$sig" == USR1 ]]; then
        ms_log "USR1: stopping the training${CHECKPOINT_DIR:+ after a checkpoint in $CHECKPOINT_DIR}, then requeueing the job"
        if [[ -z "$MS_CHILD" ]]; then
            return 0
        fi
        if [[ "$MS_CHILD_IS_SRUN" == 1 && -n "${SLURM_JOB_ID:-}" ]]; then
            scancel --signal=TERM "$SLURM_JOB_ID" || ms_warn "scancel --signal=TERM $SLURM_JOB_ID failed"
        else
            kill -TERM "$MS_CHILD" 2>/dev/null || true
        fi
        return 0
    fi
    ms_log "$sig: the job is stopping; waiting for the ranks to delete their offload files"
    if [[ -z "${SLURM_JOB_ID:-}" && -n "$MS_CHILD" ]]; then
        kill -"$sig" "$MS_CHILD" 2>/dev/null || true
    fi
}

# Install the handlers of NOTE [Job signals] in this shell.
ms_trap_job_signals() {
    trap 'ms_on_signal USR1' USR1
    trap 'ms_on_signal TERM' TERM
    trap 'ms_on_signal INT' INT
}

# ms_launch CMD...: print CMD, then (unless DRY_RUN=1) run it as a child of this shell,
# wait for it through any signal of NOTE [Job signals], and return its exit status.
ms_launch() {
    printf '+ %s\n' "$(ms_quote_cmd "$@")"
    if ms_is_dry_run; then
        return 0
    fi
    if [[ -n "$MS_STOP_SIGNAL" ]]; then
        ms_log "$MS_STOP_SIGNAL came before the launch: not starting it"
        return 1
    fi
    local word
    MS_CHILD_IS_SRUN=0
    for word in "$@"; do # the program, after `env NAME=VALUE ...`
        case "$word" in
            env | *=*) continue ;;
            srun | */srun) MS_CHILD_IS_SRUN=1 ;;
        esac
        break
    done
    (
        trap - INT QUIT
        exec "$@"
    ) &
    MS_CHILD=$!
    local rc again
    while :; do
        wait "$MS_CHILD" && rc=0 || rc=$?
        if ((rc > 128)); then
            # A handled signal interrupts wait; the child may still run, or have just ended.
            if kill -0 "$MS_CHILD" 2>/dev/null; then
                continue
            fi
            wait "$MS_CHILD" 2>/dev/null && again=0 || again=$?
            ((again == 127)) || rc=$again
        fi
        break
    done
    MS_CHILD=""
    return "$rc"
}

# ms_end_job STATUS: the batch shell's last word. After USR1, requeue the job (NOTE [Job
# signals]); after SIGTERM / SIGINT, exit 128 + the signal; else exit STATUS.
ms_end_job() {
    local rc="$1"
    case "$MS_STOP_SIGNAL" in
        USR1)
            if [[ -z "${SLURM_JOB_ID:-}" ]]; then
                ms_log "USR1 outside SLURM: stopped, nothing to requeue"
                exit 0
            fi
            ms_log "requeueing job $SLURM_JOB_ID (restart $((${SLURM_RESTART_COUNT:-0} + 1)))"
            scontrol requeue "$SLURM_JOB_ID" ||
                ms_die "'scontrol requeue $SLURM_JOB_ID' failed: submit with --requeue (or ask for JobRequeue=1)"
            exit 0
            ;;
        TERM) exit 143 ;;
        INT) exit 130 ;;
    esac
    exit "$rc"
}
