#!/usr/bin/env bash
# Everything docs/gpu.md measures on a GPU, in one run of at most ten minutes (a lent GPU machine
# is held for minutes, so the measurements go together; the steps not yet measured come first):
#   bench/gpu_scale.py       (scale) a random Qwen2.5-7B-shaped model saved as safetensors, loaded sharded;
#                            trainer steps with chunked logprobs at 8K/16K tokens (LoRA on the 7B, every
#                            weight of a 4-layer model): peak memory beside the plan's, tokens/s, MFU
#   bench/trainer.py --long  the chunked logprob pass against the full logits: peak memory and
#                            tokens/s at 8K/16K/32K tokens, hidden 2048 (the 1b shape), 151,936 vocabulary
#   bench/gpu_trainer.py     (balance) TrainEngine on long-tailed lengths: micro-batches of 4 sequences
#                            vs a 16K- and a 32K-token budget (packed + compile)
#   bench/gpu.py             publish stall, overlapped publish, pull, plain-PyTorch training (bf16 publish)
#   bench/gpu_trainer.py     TrainEngine on the same shape: packed/padded, with and without torch.compile
#   bench/gpu.py (fp32)      the fp32 publish and pull, for comparison
#   bench/trainer.py --quick TrainEngine on the tiny and ~100M models, packing off and on
#
#   bash bench/gpu_session.sh OUTDIR
#   SKIP="gpu gpu-trainer gpu-trainer-micro gpu-fp32 trainer" bash bench/gpu_session.sh OUTDIR   # the new steps only
#   SKIP="logprobs gpu-trainer-balance gpu gpu-trainer gpu-trainer-micro gpu-fp32 trainer" \
#     bash bench/gpu_session.sh OUTDIR                                   # the scale step alone (<= 10 minutes)
#
# A machine without pyzmq/pydantic/structlog gets them from wheels in .whl/ (docs/gpu.md says how to
# fetch them); the project is installed into /tmp/lam. Each step has its own time limit, and a
# failed step does not stop the next.
set -u
out=${1:-${OUT:-/tmp/gpu-session}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ! python3 -c "import zmq, pydantic, structlog, blake3" 2>/dev/null && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -c "import laminar.roles" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --no-compile --target /tmp/lam . \
    && export PYTHONPATH=/tmp/lam${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" 2>&1
step() {  # name, seconds, command...  (SKIP="name ..." leaves steps out)
  local name=$1 limit=$2; shift 2
  case " ${SKIP:-} " in *" $name "*) return ;; esac
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "=== $name: exit $? after $((SECONDS - t0)) s"
  pkill -f "bench/gpu_trainer.py" 2>/dev/null  # a variant's child outlives a killed parent
  tail -n 40 "$out/$name.log"
}
step scale 590 python3 bench/gpu_scale.py --out "$out/gpu-scale.json" --timeout 120
rm -rf /tmp/laminar-q7b 2>/dev/null
step logprobs 120 python3 bench/trainer.py --long --device cuda --hidden 2048 --out "$out/logprobs.json"
step gpu-trainer-balance 300 python3 bench/gpu_trainer.py --out "$out/gpu-trainer-balance.json" --timeout 95 \
  --lengths long-tailed --resp 4096 --groups 4 --group-size 8 \
  --variants packed+compile+m4,packed+compile+t16k,packed+compile+t32k
step gpu 150 python3 bench/gpu.py --out "$out/gpu.json"
step gpu-trainer 320 python3 bench/gpu_trainer.py --out "$out/gpu-trainer.json" --timeout 75 \
  --variants padded,padded+compile,packed,packed+compile
step gpu-trainer-micro 200 python3 bench/gpu_trainer.py --out "$out/gpu-trainer-micro.json" --timeout 80 \
  --variants packed+compile+m8,packed+compile+m16
step gpu-fp32 50 python3 bench/gpu.py --publish-dtype same --no-train --no-overlap --repeats 3 --out "$out/gpu-fp32.json"
step trainer 45 python3 bench/trainer.py --device cuda --quick --out "$out/trainer.json"
rm -rf /dev/shm/laminar-bench-* 2>/dev/null
exit 0
