#!/usr/bin/env bash
# The oldest supported releases, as setup.cfg declares them: install the pins
# of .ci/floor-pins.txt into a fresh virtual environment without system site
# packages, then run the layer's suites there on TensorFlow and on JAX. The
# layer is imported from the checkout. pip's download cache is reused.
# Usage: bash .ci/floor_check.sh  (from any directory).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  -r "$repo/.ci/floor-pins.txt" 2>&1 | { grep -v "is ignored" || true; }
"$work/venv/bin/python" - <<'PY'
import jax, keras, numpy, tensorflow
print(f"floor: keras {keras.__version__}, tensorflow {tensorflow.__version__}, "
      f"jax {jax.__version__}, numpy {numpy.__version__}")
PY

cd "$repo"
export TF_CPP_MIN_LOG_LEVEL=2
# The suites CI runs on each backend (.ci/run); Keras ships its own BN test
# file from 3.15 on, so tests/keras_suite_test.py skips on older Keras, saying so.
KERAS_BACKEND=tensorflow "$work/venv/bin/python" -m pytest -q -n 2 -m "not slow" \
  keras_bn/batch_normalization_test.py tests/keras_suite_test.py keras_bn/weight_files_test.py \
  keras_bn/conversion_test.py keras_bn/synchronized_test.py keras_bn/kernels_test.py \
  keras_bn/policies_test.py keras_bn/folding_test.py
KERAS_BACKEND=jax "$work/venv/bin/python" -m pytest -q -n 2 -m "not slow" \
  keras_bn/backends_test.py keras_bn/jax_distribution_test.py keras_bn/population_test.py \
  keras_bn/kernels_test.py keras_bn/weight_files_test.py tests/keras_suite_test.py \
  keras_bn/statistics_test.py keras_bn/accumulation_test.py keras_bn/policies_test.py \
  keras_bn/moving_statistics_test.py
