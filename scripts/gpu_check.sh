#!/bin/bash
# shellcheck shell=bash
# Check everything the GPU paths need in one short GPU window (docs/getting-started.md,
# "GPU check"): install what is missing from a wheel folder, run the gpu/kvikio/te tests,
# train a GPT sized for the GPU with keep, recompute, offload-all and the planner, train it
# again under device-memory caps of 50% and 30% of keep's peak with every peer and the planner
# (the job part: keep's out-of-memory error recorded, the gates printed), run Megatron-LM's
# own pretrain_gpt.py without and with --ssd-offload and with selective recompute, measure the
# offload path (bench-io) and the host/device copy bandwidth, and the engines and the planner on
# an emulated 4- and 8-drive NVMe array (scripts/array_standin.sh; root); write OUT/gpu-check.json
# (one entry per part: passed, failed or skipped, the reason, its numbers) and
# OUT/gpu-check.log, and print a one-screen summary. Without a CUDA device it runs the
# parts that need none and marks every GPU part skipped with the reason.
#
#   scripts/gpu_check.sh OUT [--path DIR] [--wheels DIR] [--budget SECONDS] [--bench-size SIZE]
#   make gpu-check GPU_CHECK_OUT=OUT GPU_CHECK_ARGS="--path /mnt/nvme0/act"
#
# Arguments:
#   OUT                folder for gpu-check.json and gpu-check.log (created; nothing else goes there)
# Options:
#   --path DIR         offload path to measure and train on (default: the private directory
#                      that megatron-ssd train uses, on local disk)
#   --wheels DIR       wheel folder to install missing packages from (default .whl in the
#                      repository, filled by scripts/gpu_wheels.sh where a package index is reachable)
#   --target DIR       where those wheels are installed (default $TMPDIR/megatron-ssd-gpu-check-site)
#   --budget SECONDS   time for the whole run (default 480); each part has its own timeout inside it
#   --bench-size SIZE  bytes bench-io writes per setting (default 1GiB with a GPU, 64MiB without)
#   --timeout PART=S   one part's timeout in seconds (defaults: the table below)
#   --parts LIST       run only these parts (comma-separated, in the order below); each other
#                      part is skipped with the reason (default: every part)
#   --install          install missing wheels even without a GPU (default: only with one)
#   --print-python     print the interpreter the check would use and its mode (gpu or
#                      no-gpu), then exit; OUT is not needed
#   -h, --help         this text
# Environment: PYTHON, the interpreter (nothing else is tried when it is set). Unset, the
# check tries the repository's .venv/bin/python and python3 on PATH, takes one that imports
# torch and sees a CUDA device, else the first that imports torch (.venv first). The wheels
# go into --target with pip --no-index --no-deps and are put on PYTHONPATH, so pip never
# touches the interpreter's own packages (torch above all).
# Exit status: 0 when no part failed, 1 when one did (or Python cannot import torch), 2 on a usage error.
#
# The budget (default 480 s, 15 of them kept for the summary): each part's timeout and the
# least it is started with, in seconds, and what the part took on the H200 (2026-11-26 for the
# first six; the last three on 2026-11-28, in windows cut short: docs/performance.md). Parts
# run in this order; a part the budget cuts below its minimum is skipped with the reason, and
# --parts picks the parts a short window is spent on. What CI runs (the Megatron pipeline
# tests over gloo, a second planner run with kvikio, whose engine the kvikio tests cover) is
# left out of the window.
#   part            timeout  minimum  H200
#   install             120       10    17-22
#   environment          60       10     4-5
#   copy-bandwidth       60       10     6
#   bench-io             90       15    11
#   pytest-gpu          150       30    25  (more than 60 on 2026-11-28, with the new GPU tests)
#   train               180       60   129  (then 5 placements; 4 now, kvikio's planner run left out)
#   job                 360       90   165  (of 205 s: 6 runs; the whole part is 13 to 15 runs of 15 to 60 s)
#   pretrain            240       90   152  (plain 35 s; offload 8 iterations of 4-5 s on one disk)
#   array               300       90   138  (of 200 s: bench-io and the 4-drive planner runs)
# One call of at most 10 minutes fits --parts install,environment,job --budget 560 --timeout
# job=510, or --parts install,environment,pretrain,array --budget 560; job and pretrain together
# do not fit (docs/getting-started.md, "Sizing a window").
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
PARTS=(install environment copy-bandwidth bench-io pytest-gpu train job pretrain array)
declare -A TIMEOUT=([install]=120 [environment]=60 [copy-bandwidth]=60 [bench-io]=90 [pytest-gpu]=150
    [train]=180 [job]=360 [pretrain]=240 [array]=300)
# A part whose timeout the budget cuts below this is not started.
declare -A MINIMUM=([install]=10 [environment]=10 [copy-bandwidth]=10 [bench-io]=15 [pytest-gpu]=30
    [train]=60 [job]=90 [pretrain]=90 [array]=90)
SUMMARY_RESERVE=15 # seconds kept for writing the JSON and the summary
NO_CUDA="no CUDA device visible"
TRAIN_MARGIN=20 # seconds between a training part's own budget and its hard timeout

OUT=""
OFFLOAD=""
WHEELS="$REPO/.whl"
TARGET="${TMPDIR:-/tmp}/megatron-ssd-gpu-check-site"
BUDGET=480
BENCH_SIZE=""
INSTALL=0
PRINT_PYTHON=0
SELECTED="" # --parts: the parts to run, comma-separated; empty: all

usage() {
    awk 'NR == 1 { next } /^# shellcheck/ { next } /^#/ { sub(/^# ?/, ""); if (!started && $0 == "") next; started = 1; print; next } { exit }' "${BASH_SOURCE[0]}"
}

die_usage() {
    printf '[gpu_check] ERROR: %s (see --help)\n' "$*" >&2
    exit 2
}

log() {
    printf '[gpu_check %s] %s\n' "$(date +%H:%M:%S)" "$*"
}

is_uint() {
    [[ "$1" =~ ^[0-9]+$ ]]
}

parse_args() {
    local name value
    while (($# > 0)); do
        case "$1" in
            -h | --help)
                usage
                exit 0
                ;;
            --path | --wheels | --target | --budget | --bench-size | --timeout | --parts)
                (($# >= 2)) || die_usage "$1 needs a value"
                case "$1" in
                    --path) OFFLOAD="$2" ;;
                    --wheels) WHEELS="$2" ;;
                    --target) TARGET="$2" ;;
                    --budget) BUDGET="$2" ;;
                    --bench-size) BENCH_SIZE="$2" ;;
                    --parts)
                        local part
                        [[ -n "$2" ]] || die_usage "--parts needs a comma-separated list of ${PARTS[*]}"
                        for part in ${2//,/ }; do
                            [[ -n "${TIMEOUT[$part]+set}" ]] || die_usage "--parts $2: '$part' is not a part (${PARTS[*]})"
                        done
                        SELECTED=",$2,"
                        ;;
                    --timeout)
                        name="${2%%=*}"
                        value="${2#*=}"
                        if [[ "$2" != *=* || -z "$name" || -z "${TIMEOUT[$name]+set}" ]]; then
                            die_usage "--timeout $2: must be PART=SECONDS with PART one of ${PARTS[*]}"
                        fi
                        if ! is_uint "$value" || ((10#$value == 0)); then
                            die_usage "--timeout $2: SECONDS must be a whole number > 0"
                        fi
                        TIMEOUT[$name]="$((10#$value))"
                        ;;
                esac
                shift
                ;;
            --install) INSTALL=1 ;;
            --print-python) PRINT_PYTHON=1 ;;
            -*) die_usage "unknown option $1" ;;
            *)
                [[ -z "$OUT" ]] || die_usage "one output folder only (got $OUT and $1)"
                OUT="$1"
                ;;
        esac
        shift
    done
    [[ -n "$OUT" || "$PRINT_PYTHON" == 1 ]] || die_usage "the output folder OUT is required"
    if ! is_uint "$BUDGET" || ((10#$BUDGET == 0)); then
        die_usage "--budget $BUDGET: must be a whole number of seconds > 0"
    fi
    BUDGET="$((10#$BUDGET))"
    if [[ -n "$OFFLOAD" && ! -d "$OFFLOAD" ]]; then
        die_usage "--path $OFFLOAD: not a directory (create it on the drive to measure)"
    fi
}

# torch_mode PYTHON: prints gpu or no-gpu (one start for both questions: torch imports, and a
# CUDA device is visible); fails when PYTHON cannot import torch.
torch_mode() {
    "$1" -c 'import torch; print("gpu" if torch.cuda.is_available() else "no-gpu")' 2>/dev/null
}

# Sets PY and MODE. PYTHON, when set, is the interpreter. Unset: the repository's .venv (what
# make builds) and python3 are tried; one that sees a CUDA device wins (a GPU machine's python3
# over a CPU-only .venv copied there), else the first that imports torch (a CPU machine where
# python3 has no torch and make built .venv).
pick_python() {
    local candidate mode list
    local -a tried=()
    if [[ -n "${PYTHON:-}" ]]; then
        PY="$PYTHON"
        command -v "$PY" >/dev/null 2>&1 || {
            printf '[gpu_check] ERROR: PYTHON=%s not found\n' "$PY" >&2
            exit 1
        }
        MODE="$(torch_mode "$PY")" || {
            printf '[gpu_check] ERROR: PYTHON=%s cannot import torch; the GPU check needs a Python with torch\n' \
                "$PY" >&2
            exit 1
        }
        return 0
    fi
    PY=""
    MODE=""
    for candidate in "$REPO/.venv/bin/python" python3; do
        if ! command -v "$candidate" >/dev/null 2>&1; then
            tried+=("$candidate (not found)")
        elif ! mode="$(torch_mode "$candidate")"; then
            tried+=("$candidate (cannot import torch)")
        elif [[ -z "$PY" || "$mode" == gpu ]]; then
            PY="$candidate"
            MODE="$mode"
            [[ "$mode" == gpu ]] && break
        fi
    done
    if [[ -z "$PY" ]]; then
        list="$(printf '%s, ' "${tried[@]}")"
        printf '[gpu_check] ERROR: no Python here imports torch: %s; run make to build .venv, or set PYTHON\n' \
            "${list%, }" >&2
        exit 1
    fi
}

# A JSON string of $1 (backslash, quote and control characters escaped).
json_string() {
    local s="$1"
    s="${s//\\/\\\\}"
    s="${s//\"/\\\"}"
    s="${s//$'\n'/\\n}"
    s="${s//$'\t'/\\t}"
    s="${s//$'\r'/\\r}"
    printf '"%s"' "$s"
}

# Seconds since the run started.
elapsed() {
    echo $(($(date +%s) - START))
}

# The timeout of part $1: its own, cut to what is left of the budget.
part_timeout() {
    local t="${TIMEOUT[$1]}" left
    left=$((BUDGET - $(elapsed) - SUMMARY_RESERVE))
    ((left < t)) && t=$left
    ((t < 0)) && t=0
    echo "$t"
}

next_result() {
    COUNT=$((COUNT + 1))
    RESULT="$WORK/$(printf '%02d' "$COUNT")-$1.json"
}

timing() {
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$WORK/timings.tsv"
}

# selected NAME: true when --parts left NAME in (or was not given).
selected() {
    [[ -z "$SELECTED" || "$SELECTED" == *",$1,"* ]]
}

# not_selected NAME: true, after writing NAME's skipped entry, when --parts left it out.
not_selected() {
    selected "$1" && return 1
    skip_part "$1" "not among --parts ${SELECTED:1:${#SELECTED}-2}"
}

# skip_part NAME REASON: a skipped entry, written here (no Python start for it).
skip_part() {
    next_result "$1"
    printf '{"name": %s, "status": "skipped", "reason": %s, "numbers": {}}\n' "$(json_string "$1")" \
        "$(json_string "$2")" >"$RESULT"
    log "part $1: skipped: $2"
}

# record NAME STATUS REASON: set the status of the part whose result is $RESULT (its numbers kept).
record() {
    "$PY" -m megatron_ssd_lab.gpu_check record --result "$RESULT" --name "$1" --status "$2" --reason "$3"
}

# run_part NAME COMMAND...: run COMMAND --result FILE under the part's timeout.
run_part() {
    local name="$1" t rc=0 started
    shift
    not_selected "$name" && return 0
    t="$(part_timeout "$name")"
    if ((t < TIMEOUT[$name] && t < MINIMUM[$name])); then # the budget cut it below what the part needs
        skip_part "$name" "time budget: $((BUDGET - $(elapsed))) s left of $BUDGET s, this part needs at least ${MINIMUM[$name]} s"
        return 0
    fi
    next_result "$name"
    log "part $name: starting (timeout $t s)"
    started=$(date +%s)
    timeout --kill-after=15 "$t" "$@" --result "$RESULT" || rc=$?
    timing "$name" "$(($(date +%s) - started))" "$t" "$rc"
    finish_part "$name" "$rc" "$t"
}

# finish_part NAME RC TIMEOUT: the entry of a part that timed out or wrote none.
finish_part() {
    local name="$1" rc="$2" t="$3"
    if ((rc == 124 || rc == 137)); then
        record "$name" failed "timed out after $t s (see the log)"
    elif [[ ! -s "$RESULT" ]]; then
        record "$name" failed "exited $rc without a result (see the log)"
    fi
    log "part $name: done (exit $rc)"
}

# pytest_part NAME WHAT [VAR=VALUE ...] -- PYTEST_ARGS...: pytest under the part's timeout,
# its junit XML turned into the entry.
pytest_part() {
    local name="$1" what="$2" t rc=0 started junit
    local -a envs=()
    shift 2
    not_selected "$name" && return 0
    while (($# > 0)) && [[ "$1" != "--" ]]; do
        envs+=("$1")
        shift
    done
    shift
    t="$(part_timeout "$name")"
    if ((t < TIMEOUT[$name] && t < MINIMUM[$name])); then # the budget cut it below what the part needs
        skip_part "$name" "time budget: $((BUDGET - $(elapsed))) s left of $BUDGET s, this part needs at least ${MINIMUM[$name]} s"
        return 0
    fi
    next_result "$name"
    junit="$WORK/$name.xml"
    log "part $name: starting (timeout $t s): pytest $*"
    started=$(date +%s)
    timeout --kill-after=15 "$t" env "${envs[@]}" "$PY" -m pytest -q -p no:cacheprovider --junitxml="$junit" "$@" ||
        rc=$?
    timing "$name" "$(($(date +%s) - started))" "$t" "$rc"
    if ((rc != 124 && rc != 137)); then
        "$PY" -m megatron_ssd_lab.gpu_check pytest --result "$RESULT" --name "$name" --junit "$junit" \
            --rc "$rc" --what "$what" || true
    fi
    finish_part "$name" "$rc" "$t"
}

run_all() {
    local gpu=0 size
    [[ "$MODE" == gpu ]] && gpu=1
    size="${BENCH_SIZE:-$([[ $gpu == 1 ]] && echo 1GiB || echo 64MiB)}"
    log "mode $MODE; Python $PY; offload path $OFFLOAD; budget $BUDGET s; output $OUT"

    if ((gpu || INSTALL)); then
        run_part install "$PY" -m megatron_ssd_lab.gpu_check install --mode "$MODE" --wheels "$WHEELS" \
            --target "$TARGET"
    else
        skip_part install "$NO_CUDA: no GPU part runs, so nothing is installed (--install installs anyway)"
    fi
    run_part environment "$PY" -m megatron_ssd_lab.gpu_check environment --mode "$MODE" --path "$OFFLOAD"
    if ((gpu)); then
        run_part copy-bandwidth "$PY" -m megatron_ssd_lab.gpu_check copy-bandwidth
    else
        skip_part copy-bandwidth "$NO_CUDA"
    fi
    run_part bench-io "$PY" -m megatron_ssd_lab.gpu_check bench-io --path "$OFFLOAD" --size "$size"
    if ((gpu)); then
        pytest_part pytest-gpu "the gpu/kvikio/te tests" -- -m "gpu or kvikio or te" tests
    else
        skip_part pytest-gpu "$NO_CUDA"
    fi
    if ((gpu)); then
        run_part train "$PY" -m megatron_ssd_lab.gpu_check train --path "$OFFLOAD" \
            --budget-s "$(($(part_timeout train) - TRAIN_MARGIN))"
    else
        skip_part train "$NO_CUDA"
    fi
    # Keep, the peers and the planner under caps of keep's peak; without a GPU, a tiny GPT on the
    # CPU (the cap compared, not enforced), each GPU-only row skipped with the reason.
    run_part job "$PY" -m megatron_ssd_lab.gpu_check_job --path "$OFFLOAD" \
        --budget-s "$(($(part_timeout job) - TRAIN_MARGIN))"
    # Megatron-LM's pretrain_gpt.py from ../shared, shared/ or the wheel folder (MEGATRON_LM_PATH wins).
    if ((gpu)); then
        run_part pretrain "$PY" -m megatron_ssd_lab.gpu_check_pretrain --mode gpu --path "$OFFLOAD" \
            --wheels "$WHEELS" --budget-s "$(($(part_timeout pretrain) - TRAIN_MARGIN))"
    else
        skip_part pretrain "$NO_CUDA: its CPU mode (three pretrain_gpt.py --cpu runs) is a test (make test runs it)"
    fi
    # An emulated NVMe array, one loop device over tmpfs per drive, block-throttled: bench-io on
    # it, and with a GPU the planner; without one, 2 drives at small sizes (skipped without root).
    run_part array "$PY" -m megatron_ssd_lab.gpu_check_array --mode "$MODE" \
        --budget-s "$(($(part_timeout array) - TRAIN_MARGIN))"

    local meta
    meta="{\"budget_s\": $BUDGET, \"elapsed_s\": $(elapsed), \"offload_path\": $(json_string "$OFFLOAD"),"
    meta+=" \"wheels\": $(json_string "$WHEELS"), \"target\": $(json_string "$TARGET"),"
    meta+=" \"python\": $(json_string "$PY"), \"command\": $(json_string "$COMMAND_LINE")}"
    "$PY" -m megatron_ssd_lab.gpu_check summary --work "$WORK" --out "$OUT" --mode "$MODE" --meta "$meta"
}

main() {
    COMMAND_LINE="$0 $*"
    parse_args "$@"
    pick_python
    if ((PRINT_PYTHON)); then
        printf '%s %s\n' "$PY" "$MODE"
        exit 0
    fi
    cd "$REPO"
    mkdir -p "$OUT"
    OUT="$(cd "$OUT" && pwd)"
    LOG="$OUT/gpu-check.log"
    : >"$LOG"
    rm -f "$OUT/gpu-check.json"
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
    if [[ "$MODE" == gpu || "$INSTALL" == 1 ]]; then
        export PYTHONPATH="$TARGET:$PYTHONPATH"
    fi
    if [[ -z "$OFFLOAD" ]]; then
        OFFLOAD="$("$PY" -c 'from megatron_ssd.io.scratch import default_offload_dir, make_private_dir
print(make_private_dir(default_offload_dir()))')"
    fi
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/megatron-ssd-gpu-check.XXXXXX")"
    trap 'rm -rf "$WORK"' EXIT
    START=$(date +%s)
    COUNT=0
    local status=0
    set +e
    (
        set -e
        run_all
    ) 2>&1 | tee -a "$LOG"
    status=$?
    set -e
    exit "$status"
}

main "$@"
