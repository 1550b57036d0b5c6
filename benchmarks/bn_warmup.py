r"""`--bn_momentum_warmup` on the MNIST BN network: test accuracy over the first steps.

Trains the MNIST trainer's BN network (`trainers.mnist_sigmoid
--norm=batch_norm`, seed, data order and initial kernels the same) twice, in
processes of their own on the engine of `KERAS_BACKEND`: with the moving
statistics' momentum fixed (0.99) and with TensorFlow's EMA warm-up
(`--bn_momentum_warmup`: update t uses min(0.99, (1 + t) / (10 + t))). The
test accuracy is evaluated in inference mode, i.e. with the moving
statistics, every --eval_every steps; it prints both at the --steps_shown.

Run:
    python -m benchmarks.bn_warmup --data_dir=../shared/data/tensorflow_datasets
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import app
from absl import flags

_DATA_DIR = flags.DEFINE_string("data_dir", None, "TFDS data directory holding mnist.")
_TRAIN_STEPS = flags.DEFINE_integer("train_steps", 2000, "Steps per run.", lower_bound=1)
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 100, "Steps between evaluations.", lower_bound=1)
_STEPS_SHOWN = flags.DEFINE_list(
    "steps_shown", ["100", "200", "500", "1000", "2000"], "Evaluated steps to print."
)
_SEED = flags.DEFINE_integer("seed", 0, "The runs' seed.", lower_bound=0)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def accuracies(warmup):
    """`{step: test accuracy}` of one run of the BN network."""
    model_dir = tempfile.mkdtemp(prefix="bn_warmup_")
    command = [
        sys.executable,
        "-m",
        "trainers.mnist_sigmoid",
        "--norm=batch_norm",
        f"--train_steps={_TRAIN_STEPS.value}",
        f"--eval_every={_EVAL_EVERY.value}",
        f"--seed={_SEED.value}",
        f"--model_dir={model_dir}",
        f"--bn_momentum_warmup={str(warmup).lower()}",
    ]
    if _DATA_DIR.value:
        command.append(f"--data_dir={_DATA_DIR.value}")
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    with open(os.path.join(model_dir, "batch_norm", "history.json")) as f:
        return {e["step"]: e["test_accuracy"] for e in json.load(f)["evals"]}


def main(argv):
    del argv
    runs = {"fixed momentum 0.99": accuracies(False), "--bn_momentum_warmup": accuracies(True)}
    steps = [int(s) for s in _STEPS_SHOWN.value]
    engine = os.environ.get("KERAS_BACKEND", "tensorflow")
    print(f"MNIST BN network, seed {_SEED.value}, KERAS_BACKEND={engine}: test accuracy (%)")
    print("| moving statistics | " + " | ".join(f"@{s}" for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for name, accuracy in runs.items():
        cells = " | ".join(f"{100 * accuracy[s]:.2f}" for s in steps)
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    app.run(main)
