#!/usr/bin/env bash
# The wheel as a user gets it: build it, check that it holds only keras_bn,
# install it with Keras, JAX and PyTorch (no TensorFlow) into a fresh virtual
# environment without system site packages, and run tests/wheel_smoke.py
# under KERAS_BACKEND=jax (8 host devices, keras.distribution) and
# KERAS_BACKEND=torch. pip's download cache (~/.cache/pip) is reused, so a
# warm machine installs in well under a minute (see CONTRIBUTING.md).
# Usage: bash .ci/wheel_check.sh  (from any directory; needs `build`).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Built from a copy of what a wheel is made of, so that no build/ folder of
# an earlier build in the checkout (it may hold deleted modules) is reused.
mkdir "$work/src"
cp -r "$repo"/{setup.cfg,setup.py,pyproject.toml,README.md,keras_bn} "$work/src/"
find "$work/src" -name __pycache__ -prune -exec rm -rf {} +
python -m build --wheel --outdir "$work/dist" "$work/src" > "$work/build.log" 2>&1 \
  || { cat "$work/build.log"; exit 1; }
wheel=("$work"/dist/keras_bn-*.whl)
python - "${wheel[0]}" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
bad = [n for n in names if not (n.startswith("keras_bn/") or n.startswith("keras_bn-"))]
tests = [n for n in names if n.endswith("_test.py")]
assert not bad and not tests, f"unexpected files in the wheel: {bad + tests}"
print(f"wheel: {len(names)} files, keras_bn only")
PY

# pip install into the fresh environment, without the notes about absent
# local index folders; returns pip's exit code.
venv_pip_install() {
  "$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "is ignored" || true; }
  return "${PIPESTATUS[0]}"
}

start=$SECONDS
python -m venv "$work/venv"  # no system site packages
venv_pip_install "${wheel[0]}" jax
echo "installed the wheel and jax in $((SECONDS - start)) s"
if "$work/venv/bin/python" -c "import tensorflow" 2>/dev/null; then
  echo "tensorflow is importable in the wheel's environment" >&2
  exit 1
fi
cd "$work"  # so that `import keras_bn` finds the wheel, not the checkout
KERAS_BACKEND=jax "$work/venv/bin/python" "$repo/tests/wheel_smoke.py"

start=$SECONDS
if venv_pip_install torch==2.13.0; then
  echo "installed torch in $((SECONDS - start)) s"
  KERAS_BACKEND=torch "$work/venv/bin/python" "$repo/tests/wheel_smoke.py"
else
  echo "torch==2.13.0 cannot be installed here: the wheel's PyTorch check not run"
fi
echo "wheel check passed"
