#!/usr/bin/env bash
# GPU check of the layer and its synchronisation (issue: pod-scale sync).
#
# On a machine with an NVIDIA GPU and this project installed (`pip install -e .`
# with a CUDA build of TensorFlow), from the repository root:
#     bash benchmarks/gpu_check.sh
# With one physical GPU it splits GPU 0 into 2 logical GPUs (--num_gpu_devices)
# so the synchronised runs have 2 replicas. It runs the comparison with the
# fused kernels (benchmarks/kernel_speed.py, TensorFlow, float32 and the mixed
# policies, channels-last and channels-first), the whole-model benchmark
# (benchmarks/model_speed.py, ResNet-50, TensorFlow), the layer benchmark, the
# sync benchmark and a 20-step Inception smoke under MirroredStrategy with
# --sync_batch_norm (without --jit_compile: the trainer refuses that pair under
# mirrored, see README) and with --jit_compile on local moments, then prints one
# table. Each step is bounded so the whole check stays under 13 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export TF_CPP_MIN_LOG_LEVEL=2
out=$(mktemp -d)

if ! nvidia-smi -L >"$out/gpus.txt" 2>&1; then
  echo "no NVIDIA GPU (nvidia-smi failed):"; cat "$out/gpus.txt"; exit 1
fi
gpus=$(grep -c '^GPU' "$out/gpus.txt")
split=""
[ "$gpus" -lt 2 ] && split="--num_gpu_devices=2"
python - <<'PY' || exit 1
import tensorflow as tf
gpus = tf.config.list_physical_devices("GPU")
print("TensorFlow", tf.__version__, "GPUs:", gpus)
if not gpus:
    raise SystemExit("TensorFlow sees no GPU: install a CUDA build (pip install 'tensorflow[and-cuda]').")
PY

run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "$name|$?|$((SECONDS - start))" >>"$out/status.txt"
}

run kernel_speed 300 python -m benchmarks.kernel_speed --engines=tensorflow --rounds=5 \
  --shapes=64x28x28x64,32x14x14x256 --policies=float32 --policies=mixed_bfloat16 \
  --policies=mixed_float16 --layouts=channels_last --layouts=channels_first
run model_speed 240 python -m benchmarks.model_speed --engines=tensorflow --rounds=3 \
  --policies=float32 --policies=mixed_float16
run layer_speed 90 python -m benchmarks.layer_speed --rounds 5
run layer_speed_xla 90 python -m benchmarks.layer_speed --rounds 5 --jit_compile
run sync_speed 90 python -m benchmarks.sync_speed --device=GPU --replicas=2 --rounds 7
smoke=(python -m trainers.inception_bn --use_fake_data --image_size=128 --train_steps=20
       --eval_every=10 --eval_steps=2 --batch_size=32 --distribution_strategy=mirrored $split)
run inception_sync 120 "${smoke[@]}" --sync_batch_norm --model_dir="$out/sync"
run inception_xla_local 120 "${smoke[@]}" --jit_compile --model_dir="$out/xla"

echo
echo "| check | exit | seconds | result |"
echo "|---|---|---|---|"
while IFS='|' read -r name code seconds; do
  case $name in
    layer_speed*) result=$(grep -E '^ *\(' "$out/$name.log" \
                             | awk '{s=""; for (i = 1; i <= NF - 5; i++) s = s $i; printf "%s ratio %s; ", s, $(NF - 2)}') ;;
    sync_speed) result=$(grep -E 'ratio' "$out/$name.log" | tail -1) ;;
    kernel_speed) result=$(grep -E '^tensorflow .* keras_bn  ' "$out/$name.log" \
                             | awk '{printf "%s %s %s %s; ", $2, $3, $4, $(NF - 2)}') ;;
    model_speed) result=$(grep -E '^tensorflow ' "$out/$name.log" \
                            | awk '{printf "%s %s %s; ", $2, $3, $(NF - 1)}') ;;
    inception*) result=$(python -c "import json,sys; s=json.load(open(sys.argv[1])); f=s['final']; print(f\"loss {f['loss']:.3f}, {f['images_per_sec']:.1f} images/s\")" "$out/${name#inception_}/summary.json" 2>/dev/null \
                          || echo "no summary") ;;
  esac
  echo "| $name | $code | $seconds | $result |"
done <"$out/status.txt"
echo
echo "logs: $out"
