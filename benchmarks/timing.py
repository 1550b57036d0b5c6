"""Interleaved wall-clock timing shared by the benchmarks."""

import time

import numpy as np


def time_interleaved(functions, warmup, repeats, rounds):
    """Median seconds per call of each function, measured round-robin.

    Alternating the candidates in every round exposes them to the same
    machine state (clock, other load), which matters on a shared 2-core box.

    Args:
        functions: dict name -> zero-argument callable that blocks until done.
        warmup: calls of each before timing (tracing, compilation).
        repeats: calls per timed sample.
        rounds: samples per function.

    Returns:
        dict name -> median seconds per call.
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
    return {name: float(np.median(s)) for name, s in samples.items()}
