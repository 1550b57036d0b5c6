r"""The paper's MNIST network on PyTorch compiled by Keras (`jit_compile=True`, `torch.compile`).

The network of `benchmarks.model_speed --models=mnist` (784-100-100-100-10,
sigmoid, batch norm in each hidden layer, batch 60, SGD, `train_on_batch`)
with Keras' batch norm, keras_bn's (`convert_batch_norm`), no batch norm,
and the Keras-layer floor (`benchmarks/keras_floor.py`). Each candidate
trains in a process of its own: TorchDynamo keeps its compiled graphs per
code object, and the models of one process share Keras' (`Layer.__call__`,
`Functional.call`), so a second compiled model there is timed against the
first one's guards and recompilation limits. Every round starts one process
per candidate, in turn; a process compiles in its first steps, then times
`--samples` samples of `--steps` steps and reports their median. The table
gives each candidate's median over the rounds, the lowest and highest
round, and its time over Keras' layer's as the median of the per-round
ratios; "BN cost ratio" is (candidate − no batch norm) / (Keras − no batch
norm) of the medians, as in `model_speed`; "first steps s" the median time
of the untimed first steps (compilation included).

Run:
    python -m benchmarks.torch_compile_speed
    python -m benchmarks.torch_compile_speed --nojit_compile    # the same, eager
"""

import json
import os
import subprocess
import sys
import time

from absl import app
from absl import flags
import numpy as np

CANDIDATES = ("keras", "keras_bn", "no batch norm", "keras layer floor")
_CANDIDATE = flags.DEFINE_enum("candidate", None, CANDIDATES, "One candidate (a worker).")
_JIT_COMPILE = flags.DEFINE_bool("jit_compile", True, "Keras' `compile(jit_compile=...)`.")
_PROCESSES = flags.DEFINE_integer(
    "processes", 3, "Processes per candidate, one per round.", lower_bound=1
)
_SAMPLES = flags.DEFINE_integer("samples", 9, "Timed samples per process.", lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 30, "Steps per sample.", lower_bound=1)
_FIRST_STEPS = flags.DEFINE_integer(
    "first_steps", 5, "Untimed first steps (compilation).", lower_bound=1
)
BATCH = 60


def run_candidate(name):
    """Trains one candidate in this process; prints its JSON record."""
    import keras

    from benchmarks import model_speed

    if keras.backend.backend() != "torch":
        raise RuntimeError(
            "A worker runs on PyTorch: set KERAS_BACKEND=torch. "
            f"Received: backend={keras.backend.backend()}"
        )
    keras.utils.set_random_seed(0)
    candidate = model_speed.candidate_builders()[name](model_speed.mnist_network())
    candidate.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss="sparse_categorical_crossentropy",
        jit_compile=_JIT_COMPILE.value,
    )
    rng = np.random.RandomState(0)
    x = rng.rand(BATCH, 784).astype(np.float32)
    y = rng.randint(0, 10, BATCH)
    start = time.perf_counter()
    for _ in range(_FIRST_STEPS.value):
        candidate.train_on_batch(x, y)
    warmup = time.perf_counter() - start
    samples = []
    for _ in range(_SAMPLES.value):
        start = time.perf_counter()
        for _ in range(_STEPS.value):
            candidate.train_on_batch(x, y)
        samples.append((time.perf_counter() - start) / _STEPS.value)
    record = {"candidate": name, "step_s": float(np.median(samples)), "warmup_s": warmup}
    print(json.dumps(record), flush=True)


def _worker(name):
    env = dict(os.environ, KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="2")
    args = [f"--candidate={name}", f"--jit_compile={_JIT_COMPILE.value}"]
    args += [f"--samples={_SAMPLES.value}", f"--steps={_STEPS.value}"]
    args += [f"--first_steps={_FIRST_STEPS.value}"]
    # The worker's stderr goes to this process's: a failing worker shows why.
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.torch_compile_speed", *args],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    ).stdout
    records = [line for line in out.splitlines() if line.startswith("{")]
    if not records:
        raise RuntimeError(f"The {name} worker printed no record. Its output: {out}")
    return json.loads(records[-1])


def main(argv):
    del argv
    if _CANDIDATE.value:
        run_candidate(_CANDIDATE.value)
        return
    rounds = [[_worker(name) for name in CANDIDATES] for _ in range(_PROCESSES.value)]
    steps = {n: np.array([r[i]["step_s"] for r in rounds]) * 1e3 for i, n in enumerate(CANDIDATES)}
    warmups = {n: np.median([r[i]["warmup_s"] for r in rounds]) for i, n in enumerate(CANDIDATES)}
    medians = {name: float(np.median(values)) for name, values in steps.items()}
    mode = "jit_compile=True (torch.compile)" if _JIT_COMPILE.value else "eager"
    print(f"MNIST network, batch {BATCH}, PyTorch, {mode}; {_PROCESSES.value} processes each")
    print(
        f"{'candidate':<20}{'step ms [min–max]':>24}{'/ Keras [min–max]':>22}"
        f"{'BN cost ratio':>15}{'first steps s':>15}"
    )
    for name, values in steps.items():
        ratios = values / steps["keras"]
        cost = ""
        if name not in ("keras", "no batch norm"):
            none = medians["no batch norm"]
            cost = f"{(medians[name] - none) / (medians['keras'] - none):.2f}"
        print(
            f"{name:<20}{medians[name]:10.2f} [{values.min():.2f}–{values.max():.2f}]"
            f"{np.median(ratios):9.3f} [{ratios.min():.3f}–{ratios.max():.3f}]"
            f"{cost:>15}{warmups[name]:15.1f}"
        )


if __name__ == "__main__":
    app.run(main)
