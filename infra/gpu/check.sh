#!/usr/bin/env bash
# check.sh (`make gpu-check`): the GPU check of issue 7, in one call on a machine with one
# NVIDIA GPU and no network (infra/gpu/README.md). From the repository root:
#
#   OUT_DIR=/some/folder bash infra/gpu/check.sh          # or: make gpu-check OUT_DIR=...
#
# It needs .gpu-wheels/ (`make gpu-wheels`, made where PyPI is reachable) and the demo's
# shards runs/demo/shards/ (`make demo`), both carried beside the checkout. Steps:
#   1. install the wheels into a private folder (mktemp -d; pip, no index, no dependencies), put
#      it and the checkout on PYTHONPATH, so that `python3 -m bertpipe.app.cli` runs the CLI;
#   2. print the versions (python, torch, CUDA, GPU, deepspeed, transformers) and nvidia-smi;
#   3. (no op compile: AdamW is torch's fused kernel on CUDA, optimizer.fused=auto);
#   4. the benchmark runs, BERT-Large, bf16, ZeRO 1, AdamW, each its own process under
#      `timeout`, most important first: phase 1 (128 x 64) unpadded, transformers, padded;
#      the same for phase 2 (512 x 16); 200 steps of real pre-training on the demo's seq128
#      shards (bf16, phase 1 only); `bertpipe plan --fit` for this GPU and the LAMB recipe,
#      its written config run for a few steps at each phase's chosen micro batch, peak memory
#      against the plan and its budget; ModernBERT-large at both shapes, unpadded; last the
#      compiled (torch.compile) unpadded runs.
# Each run appends one JSON object to $OUT_DIR/gpu-check.jsonl (its figures, or
# {"name": ..., "error": ...}) and its whole output to $OUT_DIR/gpu-check.log; a failed run
# does not stop the check. A wall-clock budget (GPU_CHECK_BUDGET_S) bounds the whole check:
# every run's timeout is cut to what is left, and once less than 60 s is left the remaining
# runs are skipped (recorded with "skipped"). Last comes a summary table
# ($OUT_DIR/gpu-check-summary.txt) built from the JSONL.
#
# Environment:
#   OUT_DIR              output folder (default runs/gpu-check)
#   PYTHON               the Python to use (default python3)
#   GPU_CHECK_SMOKE=1    CPU smoke mode for tests: tiny preset, fp32, micro batches of 8 and
#                        4, 2 timed steps, 4 pre-training steps; the wheels are installed
#                        only if deepspeed or webdataset does not import already
#   GPU_CHECK_BUDGET_S   seconds for the whole check (default 465 on the GPU, 1800 smoke)
#   GPU_CHECK_FIT_GPU    the GPU type `plan --fit` ranks with (default h200); its memory is
#                        the device's own, as torch reports it
#   GPU_CHECK_ONLY       an extended regex: run only the steps whose name matches it
#   GPU_CHECK_DRY_RUN=1  set nothing up and run nothing: print each run's command line
#                        ("+ NAME: COMMAND", shell-quoted) and record it as skipped
#   GPU_CHECK_SHARDS     the demo's shard folder holding seq128/ and seq512/ (default
#                        runs/demo/shards)
#   GPU_CHECK_WHEELS     the wheel folder (default .gpu-wheels)
#   GPU_CHECK_SITE       where the wheels are installed (default: site/ in this run's private
#                        mktemp -d folder, removed at exit; never a fixed name in /tmp, where
#                        another user could plant code that this check then imports)
#
# Exit status: 0 when every run that ran succeeded, 1 when one failed, 2 when the set-up
# (install, imports, no GPU) failed.
set -uo pipefail
# every run below is its own one-process job: not part of a job this shell may sit in
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT
export LC_ALL=C

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 2
START=$SECONDS

OUT_DIR=${OUT_DIR:-runs/gpu-check}
PY=${PYTHON:-python3}
SMOKE=${GPU_CHECK_SMOKE:-0}
ONLY=${GPU_CHECK_ONLY:-}
DRY=${GPU_CHECK_DRY_RUN:-0}
SHARDS=${GPU_CHECK_SHARDS:-runs/demo/shards}
WHEELS=${GPU_CHECK_WHEELS:-.gpu-wheels}
HELPER=$ROOT/infra/gpu/gpu_check.py
RESERVE_S=60

mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd) || exit 2
[[ $SHARDS == /* ]] || SHARDS=$ROOT/$SHARDS
JSONL=$OUT_DIR/gpu-check.jsonl
LOG=$OUT_DIR/gpu-check.log
ENV_JSON=$OUT_DIR/gpu-check-env.json
SUMMARY=$OUT_DIR/gpu-check-summary.txt
: >"$JSONL"
: >"$LOG"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX") || exit 2
trap 'rm -rf "$WORK"' EXIT
SITE=${GPU_CHECK_SITE:-$WORK/site}

if [[ $SMOKE == 1 ]]; then
    MODE="CPU smoke"
    DEVICE=cpu PRESET=tiny MODERN_PRESET=tiny PRECISION=fp32
    EAGER=(--steps 2 --warmup 1) COMPILED=(--steps 2 --warmup 1)
    MICRO1=8 MICRO2=4  # the plumbing is under test, not the shapes: small batches on a CPU
    PRETRAIN_STEPS=4 LOG_EVERY=2 PLANNED_STEPS=2
    # the demo recipe on a pretend 3 GiB device: the plumbing, not the figures
    FIT=(--config configs/pretrain-demo.yaml --cpu --gpu-memory-gb 3) FIT_SET=(device_peak_tflops=1)
    BUDGET_S=${GPU_CHECK_BUDGET_S:-1800}
    T_EAGER=300 T_COMPILED=600 T_PRETRAIN=300
    export DS_ACCELERATOR=cpu
else
    MODE="GPU"
    DEVICE=cuda PRESET=large MODERN_PRESET=modernbert-large PRECISION=bf16
    EAGER=(--steps 20 --warmup 5) COMPILED=(--steps 20 --warmup 10)
    MICRO1=64 MICRO2=16
    PRETRAIN_STEPS=200 LOG_EVERY=20 PLANNED_STEPS=4
    FIT=(--config configs/pretrain-bert-large-lamb.yaml --gpu "${GPU_CHECK_FIT_GPU:-h200}")
    FIT_SET=()
    BUDGET_S=${GPU_CHECK_BUDGET_S:-465}
    T_BUILD=180 T_EAGER=90 T_COMPILED=240 T_PRETRAIN=150
    export DS_ACCELERATOR=cuda
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
fi
# nothing may be fetched: fail at once instead of waiting on the network
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# compiled ops are loaded from here: this run's private folder unless one is given
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$WORK/torch_extensions}
unset MLFLOW_TRACKING_URI
# the Python's own bin folder (ninja, for DeepSpeed's just-in-time ops) first on PATH
if PY_PATH=$(command -v "$PY"); then
    export PATH="$(dirname "$PY_PATH"):$PATH"
fi
BP=("$PY" -m bertpipe.app.cli)  # the console script `bertpipe`, without installing it

say() { echo "[gpu-check] $*" | tee -a "$LOG"; }
elapsed() { echo $((SECONDS - START)); }

summary() {
    say "summary"
    "$PY" "$HELPER" summary "$JSONL" --env "$ENV_JSON" --elapsed "$(elapsed)" \
        --budget "$BUDGET_S" | tee "$SUMMARY" | tee -a "$LOG"
    say "outputs: $JSONL, $LOG, $SUMMARY, $ENV_JSON"
}

setup_failed() {
    say "set-up failed: $1"
    "$PY" - "$JSONL" "$1" <<'EOF'
import json, sys
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"name": "setup", "error": sys.argv[2]}) + "\n")
EOF
    summary
    exit 2
}

# run_step NAME PLANNED_TIMEOUT KIND COMMAND...: one run, its own process; KIND is
# "pretrain" for a `bertpipe pretrain` run (losses read from its log), else empty
run_step() {
    local name=$1 planned=$2 kind=$3
    shift 3
    if [[ -n $ONLY && ! $name =~ $ONLY ]]; then
        return 0
    fi
    if [[ $DRY == 1 ]]; then
        printf '+ %s:' "$name" | tee -a "$LOG"
        printf ' %q' "$@" | tee -a "$LOG"
        echo | tee -a "$LOG"
        "$PY" "$HELPER" skip "$JSONL" "$name" "dry run" >>"$LOG"
        return 0
    fi
    local left=$((BUDGET_S - $(elapsed)))
    if ((left < RESERVE_S)); then
        "$PY" "$HELPER" skip "$JSONL" "$name" \
            "time budget: $left s of $BUDGET_S s left (< $RESERVE_S s)" | tee -a "$LOG"
        return 0
    fi
    local limit=$planned
    ((limit > left - 15)) && limit=$((left - 15))
    say "run $name (timeout $limit s; $(elapsed) s elapsed, $left s of the budget left)"
    echo "+ $*" >>"$LOG"
    local t0=$EPOCHREALTIME rc
    timeout -k 10 "$limit" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err"
    rc=$?
    local wall
    wall=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
    {
        echo "--- $name: stderr"
        cat "$WORK/$name.err"
        echo "--- $name: stdout"
        cat "$WORK/$name.out"
        echo "--- $name: exit $rc after $wall s"
    } >>"$LOG"
    local extra=()
    if [[ $kind == pretrain ]]; then
        extra=(--pretrain)
        say "$name: logged losses"
        grep -E ' step [0-9]+/[0-9]+ \(global [0-9]+\): loss ' "$WORK/$name.err" \
            | sed 's/^/    /' | tee -a "$LOG"
    fi
    "$PY" "$HELPER" record "$JSONL" "$name" --rc "$rc" --wall "$wall" --timeout "$limit" \
        --stdout "$WORK/$name.out" --stderr "$WORK/$name.err" "${extra[@]}" | tee -a "$LOG"
}

say "mode: $MODE; budget $BUDGET_S s; output $OUT_DIR; $(date -u +%Y-%m-%dT%H:%M:%SZ)"

if [[ $DRY == 1 ]]; then
    say "dry run: the commands only"
else
# ---------------------------------------------------------------- 1. install, offline
imports_ok() { "$PY" -c "import deepspeed, webdataset, hjson, pydantic" >/dev/null 2>&1; }
wheels=()
for w in "$WHEELS"/*.whl; do
    [[ -e $w ]] && wheels+=("$w")
done
if ((${#wheels[@]})) && { [[ $SMOKE != 1 ]] || ! imports_ok; }; then
    say "installing ${#wheels[@]} wheels from $WHEELS into $SITE (no index, no dependencies)"
    rm -rf "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${wheels[@]}" >>"$LOG" 2>&1 \
        || setup_failed "pip install of $WHEELS/*.whl failed (see the log)"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
elif imports_ok; then
    say "no wheels installed: deepspeed and webdataset import already (${#wheels[@]} in $WHEELS)"
else
    setup_failed "deepspeed/webdataset do not import and $WHEELS holds no wheels: run \
\`make gpu-wheels\` where PyPI is reachable and carry .gpu-wheels"
fi
# bertpipe from this checkout, without installing it: the checkout keeps one folder per
# stage (training/ is installed as bertpipe.training), so a view of the package is linked
# together under the output folder, as the wheel would lay it out
SRC="$OUT_DIR/.bertpipe-src"
rm -rf "$SRC" && mkdir -p "$SRC/bertpipe"
ln -s "$ROOT"/bertpipe/*.py "$SRC/bertpipe/"
for part in configs preprocessing training finetuning; do
    ln -s "$ROOT/$part" "$SRC/bertpipe/$part"
done
export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import bertpipe.app.cli, bertpipe.training.pretrain.trainer, bertpipe.training.pretrain.data.loader, deepspeed" \
    >>"$LOG" 2>&1; then
    setup_failed "bertpipe's training modules do not import (see the log)"
fi
say "set-up done in $(elapsed) s"

# ---------------------------------------------------------------- 2. versions
say "versions"
"$PY" "$HELPER" env "$ENV_JSON" 2>>"$LOG" | tee -a "$LOG"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi 2>&1 | tee -a "$LOG"
else
    say "nvidia-smi: not found"
fi
if [[ $SMOKE != 1 ]] && ! "$PY" -c \
    "import json, sys; sys.exit(0 if json.load(open(sys.argv[1])).get('cuda_available') else 1)" \
    "$ENV_JSON"; then
    setup_failed "torch sees no CUDA device (for the CPU smoke mode set GPU_CHECK_SMOKE=1)"
fi
if [[ -f $SHARDS/seq128/manifest.json && -f $SHARDS/seq512/manifest.json ]]; then
    say "shards: $(du -sh "$SHARDS" | cut -f1) in $SHARDS"
else
    say "shards: $SHARDS/seq128 or seq512 has no manifest.json: run \`make demo\` and carry" \
        "runs/demo/shards (the pre-training run will fail)"
fi

fi  # dry run

# ---------------------------------------------------------------- 4. the runs
COMMON=(--preset "$PRESET" --precision "$PRECISION" --zero 1 --optimizer adamw
    --device "$DEVICE")
P1=(--seq-len 128 --micro-batch "$MICRO1")
P2=(--seq-len 512 --micro-batch "$MICRO2")
bench() {  # bench NAME TIMEOUT ARGS...
    local name=$1 limit=$2
    shift 2
    run_step "$name" "$limit" "" "${BP[@]}" bench train "${COMMON[@]}" --name "$name" "$@"
}

bench p1-unpad "$T_EAGER" "${P1[@]}" --padding unpad "${EAGER[@]}"
bench p1-hf "$T_EAGER" "${P1[@]}" --model hf "${EAGER[@]}"
bench p1-pad "$T_EAGER" "${P1[@]}" --padding pad "${EAGER[@]}"
bench p2-unpad "$T_EAGER" "${P2[@]}" --padding unpad "${EAGER[@]}"
bench p2-hf "$T_EAGER" "${P2[@]}" --model hf "${EAGER[@]}"
bench p2-pad "$T_EAGER" "${P2[@]}" --padding pad "${EAGER[@]}"

run_step pretrain-demo "$T_PRETRAIN" pretrain "${BP[@]}" pretrain \
    --config configs/pretrain-demo.yaml \
    "output=$WORK/pretrain" \
    "phases[0].data=$SHARDS/seq128" \
    "phases[1].data=$SHARDS/seq512" \
    "phases[0].max_steps=$PRETRAIN_STEPS" \
    only_phase=phase1 \
    "precision=$PRECISION" \
    "log_every_steps=$LOG_EVERY" \
    checkpoint.every_steps=0 \
    checkpoint.resume=none \
    tracking.enabled=false

# plan --fit (issue 29): the fastest configuration of the recipe that fits this GPU, written
# as a config; then each phase of that config for a few steps at the chosen micro batch (the
# global batch cut to one micro batch: memory depends on the micro batch, not on the
# accumulation), its peak memory set against the plan's prediction and the budget it fitted
# into (gpu_check.py planned_record: over the budget is a failure)
GPU_GIB=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("gpu_memory_gib") or "")' \
    "$ENV_JSON" 2>/dev/null)
[[ $SMOKE != 1 && -n $GPU_GIB ]] && FIT+=(--gpu-memory-gb "$GPU_GIB")
run_step plan-fit 60 "" "${BP[@]}" plan "${FIT[@]}" --nodes 1 --gpus-per-node 1 \
    --fit --write "$WORK/planned.yaml" --json "precision=$PRECISION" "${FIT_SET[@]}"
# both phases cut the same way in both runs (phase 2 starts from phase 1's final checkpoint
# in the same output folder, as a real run's phase 2 does)
PLANNED_SET=()
planned_run() {  # planned_run NAME PHASE_INDEX
    local name=$1 i=$2 micro=MICRO j
    [[ -n $ONLY && ! $name =~ $ONLY ]] && return 0
    if ((${#PLANNED_SET[@]} == 0)); then
        for j in 0 1; do
            if [[ $DRY != 1 ]] && ! micro=$("$PY" "$HELPER" planned-micro "$JSONL" plan-fit "$j" \
                2>>"$LOG"); then
                "$PY" "$HELPER" skip "$JSONL" "$name" "plan-fit wrote no config" | tee -a "$LOG"
                return 0
            fi
            PLANNED_SET+=("phases[$j].global_batch_size=$micro" "phases[$j].max_steps=$PLANNED_STEPS")
        done
    fi
    run_step "$name" "$T_PRETRAIN" pretrain "${BP[@]}" pretrain --config "$WORK/planned.yaml" \
        "output=$WORK/planned" \
        "phases[0].data=$SHARDS/seq128" \
        "phases[1].data=$SHARDS/seq512" \
        "only_phase=phase$((i + 1))" \
        "${PLANNED_SET[@]}" \
        log_every_steps=1 \
        eval.every_steps=0 \
        checkpoint.every_steps=0 \
        tracking.enabled=false
}
planned_run planned-p1 0
planned_run planned-p2 1

# the modern family (issue 27): ModernBERT-large, the same shapes, unpadded (its local layers
# use FlashAttention's window when flash_attn is installed, else a band mask per sequence)
bench p1-modern "$T_EAGER" "${P1[@]}" --padding unpad --family modernbert \
    --preset "$MODERN_PRESET" "${EAGER[@]}"
bench p2-modern "$T_EAGER" "${P2[@]}" --padding unpad --family modernbert \
    --preset "$MODERN_PRESET" "${EAGER[@]}"

bench p1-unpad-compiled "$T_COMPILED" "${P1[@]}" --padding unpad --compile "${COMPILED[@]}"
bench p2-unpad-compiled "$T_COMPILED" "${P2[@]}" --padding unpad --compile "${COMPILED[@]}"

# ---------------------------------------------------------------- 5. summary
summary
"$PY" - "$JSONL" <<'EOF'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
sys.exit(1 if any("error" in r for r in records) else 0)
EOF
