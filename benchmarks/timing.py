"""Interleaved wall-clock timing shared by the benchmarks, and their per-engine processes."""

import json
import os
import subprocess
import sys
import time

import numpy as np


def time_rounds(functions, warmup, repeats, rounds):
    """Seconds per call of each function in every round, measured round-robin.

    Alternating the candidates in every round exposes them to the same
    machine state (clock, other load), which matters on a shared 2-core box;
    a round's samples are paired, so per-round ratios can be taken.

    Args:
        functions: dict name -> zero-argument callable that blocks until done.
        warmup: calls of each before timing (tracing, compilation).
        repeats: calls per timed sample.
        rounds: samples per function.

    Returns:
        dict name -> list of `rounds` seconds per call, in round order.
    """
    for fn in functions.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in functions}
    for _ in range(rounds):
        for name, fn in functions.items():
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            samples[name].append((time.perf_counter() - start) / repeats)
    return samples


def time_interleaved(functions, warmup, repeats, rounds):
    """Median seconds per call of each function (see `time_rounds`)."""
    samples = time_rounds(functions, warmup, repeats, rounds)
    return {name: float(np.median(s)) for name, s in samples.items()}


def records_per_engine(module, engines):
    """Runs `python -m module --engine=E` per engine, with this process's other flags.

    Keras picks its backend once per process, so each engine runs in its
    own, under `KERAS_BACKEND=E`; each prints one JSON record per line.

    Returns:
        The records of every engine, in order.
    """
    records = []
    args = [a for a in sys.argv[1:] if not a.startswith("--engine")]
    for engine in engines:
        env = dict(os.environ, KERAS_BACKEND=engine, TF_CPP_MIN_LOG_LEVEL="2")
        out = subprocess.run(
            [sys.executable, "-m", module, f"--engine={engine}", *args],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        records += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return records
