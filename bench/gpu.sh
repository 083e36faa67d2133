#!/usr/bin/env bash
# The GPU check: the speed benchmark on one GPU, then data-parallel foundation training on one GPU
# and on all GPUs (torchrun, DDP over NCCL), printing entities/s and events/s per GPU; then
# predictions and embeddings in one process on one GPU against one process per GPU (models/serve/parts.py).
#
#   bench/gpu.sh                      # 1M generated events (DATASETS=1m,10m,tafeng for more)
#   WORK=/scratch/speed PRECISION=bf16 bench/gpu.sh
#
# Needs a CUDA build of torch in $PYTHON's environment (default .venv/bin/python). Writes
# $WORK/gpu1.json (the stage table on one GPU), $WORK/inference.json (1 GPU vs all) and prints the
# per-GPU scaling tables. INFER_CUSTOMERS (default 175000, bench/speed.py's 10m) sizes the inference run.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
DATASETS=${DATASETS:-1m}
PRECISION=${PRECISION:-bf16}
WORK=${WORK:-$(mktemp -d -t habitus-gpu-XXXXXX)}

GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "$GPUS" -lt 1 ]; then
    echo "bench/gpu.sh: torch sees no CUDA device ($("$PY" -c 'import torch; print(torch.__version__)')); run it on a GPU machine with a CUDA build of torch" >&2
    exit 1
fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader || true
echo "work folder $WORK; $GPUS GPU(s); training precision $PRECISION"

# 1. every stage on one GPU (inference precisions fp32 and bf16: int8 kernels are CPU-only)
"$PY" bench/speed.py --device cuda --datasets "$DATASETS" --precisions fp32,bf16 --work "$WORK" \
    --json "$WORK/gpu1.json"

# 2. data-parallel foundation steps: 1 GPU, then all of them; figures are per GPU
first=${DATASETS%%,*}
config="$WORK/$first/project.yaml"
results=()
for n in $(printf '%s\n' 1 "$GPUS" | sort -un); do
    line=$("$PY" -m torch.distributed.run --standalone --nproc_per_node "$n" bench/speed.py \
        --ddp "$config" --device cuda --precision "$PRECISION" | grep '^RESULT ' | tail -1)
    results+=("${line#RESULT }")
done

"$PY" - "${results[@]}" <<'EOF'
import json, sys
rows = [json.loads(a) for a in sys.argv[1:]]
base = rows[0]["entities_per_s"]
print("%4s %9s %8s %19s %17s %8s" % ("GPUs", "precision", "epoch s", "entities/s per GPU", "events/s per GPU",
                                      "scaling"))
for r in rows:
    print("%4d %9s %8.1f %19s %17s %8.2f" % (r["processes"], r["precision"], r["epoch_seconds"],
                                             f"{r['entities_per_s']:,.0f}", f"{r['events_per_s']:,.0f}",
                                             r["entities_per_s"] / base))
print("scaling = throughput per GPU with n GPUs / with 1 GPU (1.00 = linear)")
EOF

# 3. inference, 1 GPU vs all: churn scores and embeddings of every entity into the day's file, one
# process against one per GPU (bench/inference_procs.py; the trained checkpoints of step 1 when it ran
# on that dataset, else the demo's shapes with random weights); its table ends with the median ratio
if [ "$GPUS" -gt 1 ]; then
    customers=${INFER_CUSTOMERS:-175000}
    ws="$WORK/$(case $customers in 17500) echo 1m;; 175000) echo 10m;; 1750000) echo 100m;; *) echo demo$customers;; esac)/ws"
    trained=()
    if [ -f "$ws/checkpoints/scenarios/churn/config.json" ] && [ -f "$ws/checkpoints/foundation/config.json" ]; then
        trained=(--scenario "$ws/checkpoints/scenarios/churn" --foundation "$ws/checkpoints/foundation")
    fi
    "$PY" bench/inference_procs.py --device cuda --processes "1,$GPUS" --customers "$customers" --work "$WORK" \
        ${trained[@]+"${trained[@]}"} --json "$WORK/inference.json"
else
    echo "inference 1 GPU vs all: one GPU visible, nothing to compare"
fi
