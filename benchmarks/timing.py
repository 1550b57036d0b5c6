"""Interleaved wall-clock timing shared by the benchmarks."""

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
