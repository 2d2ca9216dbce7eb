#!/bin/bash
# One GPU contact in one command (docs/gpu.md): start-up with burn's kernel cache cold and warm,
# speed against PyTorch on the same GPU, two ranks on the one GPU (NCCL when it allows two ranks
# per GPU, else the host path), a rank killed mid-step, and the device gradient path with fusion
# at one rank. For a machine with an NVIDIA GPU, python3 with torch, no cargo and no network:
#
#   BIN=<folder of ddprun, ddp-nccl-bench, train-mnist built with ddp-apps/cuda>
#   DATA=<folder of the four MNIST .gz files>  OUT=<folder for the logs>
#   bash xtask/scripts/gpu-contact.sh
#
# Every step has its own time limit; a step that fails is reported and the next one runs.
# The summary lines start with "ROW".
set -u
: "${BIN:?}" "${DATA:?}" "${OUT:?}"
export PYTHONUNBUFFERED=1 RUST_BACKTRACE=1
here=$(cd "$(dirname "$0")" && pwd)
log=$OUT/contact.log
exec > >(tee -a "$log") 2>&1
t0=$(date +%s.%N)
since() { awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $t0 }"; }
row() { echo "ROW $*"; }

nvidia-smi -L
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())' || true

# NVRTC: this build's CUDA 12.8 bindings open libnvrtc.so or libnvrtc.so.12; a machine with
# CUDA 13 only has libnvrtc.so.13, offered here as libnvrtc.so (docs/gpu.md, first contact).
if ! ldconfig -p | grep -q 'libnvrtc.so.12'; then
    nvrtc=$(python3 -c 'import nvidia, os, glob; print(sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], "**", "libnvrtc.so.1[23]*"), recursive=True))[0])' 2>/dev/null)
    [ -z "$nvrtc" ] && nvrtc=$(find / -xdev -name 'libnvrtc.so.1[23]*' 2>/dev/null | grep -v builtins | head -1)
    mkdir -p /tmp/nvrtc-link && ln -sf "$nvrtc" /tmp/nvrtc-link/libnvrtc.so
    for b in "$(dirname "$nvrtc")"/libnvrtc-builtins.so*; do ln -sf "$b" /tmp/nvrtc-link/; done
    export LD_LIBRARY_PATH=/tmp/nvrtc-link:${LD_LIBRARY_PATH:-}
    echo "NVRTC offered as libnvrtc.so: $nvrtc"
fi
export VIRTUAL_ENV=${VIRTUAL_ENV:-$(python3 -c 'import sys; print(sys.prefix)')}

"$BIN/ddp-nccl-bench" --probe || true

common=(--backend cuda --batch-size 64 --data-dir "$DATA" --log-interval 50)
# A trainer run: name, time limit, then ddprun's and the trainer's arguments; its log in $OUT.
trainer() {
    local name=$1 limit=$2 nproc=$3
    shift 3
    local start
    start=$(date +%s.%N)
    timeout -k 5 "$limit" "$BIN/ddprun" --nproc-per-node "$nproc" -- "$BIN/train-mnist" \
        "${common[@]}" --json "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local wall
    wall=$(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $start }")
    local first
    first=$(grep -o 'first step done [0-9.]* s' "$OUT/$name.log" | head -1 | grep -o '[0-9.]* s')
    local json
    json=$(grep -o 'DDP_SUMMARY {.*' "$OUT/$name.log" | tail -1 | cut -c13-)
    row "$name rc=$rc wall=${wall}s first_step=${first:-none} $(echo "$json" | python3 -c 'import json,sys
try:
    s=json.loads(sys.stdin.read()); print("steps=%s sps=%.0f acc=%.4f loss=%.4f comm=%.3fs buckets=%s hash=%s" % (s["steps"], s["samples_per_sec"], s["test_accuracy"], s["train_loss"], s["comm_seconds"], s["buckets"], s["params_hash"]))
except Exception as e: print("no summary")')"
    grep -m3 'CUDA libraries\|kernel cache\|DDP' "$OUT/$name.log" | cut -c1-400
    tail -n 3 "$OUT/$name.log" | cut -c1-300
}

cache=/tmp/ddp-cache
rm -rf "$cache"
export DDP_CACHE_DIR=$cache
# 1. Start: cold (empty cache), then warm (a second process, the same cache).
trainer cold 240 1 --max-steps 100 --test-samples 2000
du -sh "$cache" 2>/dev/null; find "$cache" -maxdepth 3 | head -10
trainer warm 90 1 --max-steps 100 --test-samples 2000
# 2. Speed: two epochs (the first one's shapes are in the cache now), epoch 2 timed from
#    metrics.csv, against PyTorch on the same GPU and batch.
trainer speed 90 1 --epochs 2 --metrics-dir "$OUT/speed-metrics"
[ -f "$OUT/speed-metrics/metrics.csv" ] && grep -v '^epoch,step' "$OUT/speed-metrics/metrics.csv" | tail -3
timeout -k 5 90 python3 "$here/torch_mnist_epoch.py" --data-dir "$DATA" --device cuda:0 \
    --epochs 1 --warmup-epochs 1 --batch-size 64 2>&1 | grep TORCH_SUMMARY | sed 's/^/ROW /'
# 3. Two ranks on the one GPU: the host path (NCCL before 2.30 refuses two ranks on one GPU),
#    the time DDP adds per step against one rank; then a rank killed mid-step.
DDP_NCCL=0 CUDA_VISIBLE_DEVICES=0 trainer two-ranks 90 2 --max-steps 300 --test-samples 2000
trainer one-rank 60 1 --max-steps 300 --test-samples 2000
DDP_NCCL=0 CUDA_VISIBLE_DEVICES=0 DDP_TEST_KILL_AT_STEP=40 DDP_TEST_KILL_RANK=1 trainer kill 60 2 --max-steps 300 \
    --test-samples 2000
grep -i -m5 'root cause\|rank 1\|signal\|failed' "$OUT/kill.log" | cut -c1-300
# 4. The device gradient path with fusion at one rank (NCCL of one rank; every other part of
#    the path runs): f32 and bf16.
DDP_NCCL=1 trainer device-f32 60 1 --max-steps 100 --test-samples 2000
DDP_NCCL=1 trainer device-bf16 60 1 --max-steps 100 --test-samples 2000 --comm-hook bf16
for n in cold warm one-rank device-f32 device-bf16; do
    echo "$n: $(grep -o 'step 100 .*loss [0-9.]*' "$OUT/$n.log" | tail -1)"
done
du -sh "$cache"
echo "total $(since) s"
