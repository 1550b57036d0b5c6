"""Launching the worker processes of a multi-process job on 127.0.0.1.

Each worker is `python -m MODULE ARGS...` in its own process with its own
cluster environment: TF_CONFIG for a MultiWorkerMirroredStrategy job
(`tf_config_env`), Keras' KERAS_DISTRIBUTION_* variables for a JAX
`keras.distribution` job (`keras_distribution_env`). Ports are picked free by
the OS, but another process may take one between the pick and the worker
binding it, so a launch whose worker reports an address clash is retried
with new ports. Every process is killed in `finally`, and the launch's waits
together are bounded.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CLASH = ("Address already in use", "Failed to add port", "address in use")


def free_ports(count):
    """`count` distinct ports that were free on 127.0.0.1 a moment ago."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config_env(addresses, index):
    """Worker `index`'s TF_CONFIG in a cluster of workers at `addresses`."""
    return {
        "TF_CONFIG": json.dumps(
            {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
        )
    }


def keras_distribution_env(addresses, index):
    """Process `index`'s variables for `keras.distribution.initialize()` (the first coordinates)."""
    return {
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": ",".join(addresses),
        "KERAS_DISTRIBUTION_NUM_PROCESSES": str(len(addresses)),
        "KERAS_DISTRIBUTION_PROCESS_ID": str(index),
    }


def run_workers(
    module, args_per_worker, timeout_s, env=None, attempts=3, cluster_env=tf_config_env
):
    """Runs one worker per entry of `args_per_worker`; returns their outputs.

    Args:
        module: the module each worker runs with `python -m`.
        args_per_worker: a list with each worker's extra arguments.
        timeout_s: the bound on the whole launch, per attempt.
        env: extra environment variables for every worker.
        attempts: launches tried when a worker reports a port clash.
        cluster_env: `(addresses, index) -> dict`, a worker's cluster
            variables (`tf_config_env` or `keras_distribution_env`).

    Returns:
        A list of `(returncode, output)`, one per worker.
    """
    launch = lambda: _launch(module, args_per_worker, timeout_s, env or {}, cluster_env)
    results = launch()
    for _ in range(attempts - 1):
        if not _port_clash(results):
            break
        results = launch()
    return results


def _port_clash(results):
    return any(code != 0 and any(c in out for c in _CLASH) for code, out in results)


def _launch(module, args_per_worker, timeout_s, extra_env, cluster_env):
    workers = [f"127.0.0.1:{port}" for port in free_ports(len(args_per_worker))]
    processes, outputs = [], []
    deadline = time.monotonic() + timeout_s
    try:
        for index, args in enumerate(args_per_worker):
            env = dict(os.environ)
            env.update(extra_env)
            env.update(cluster_env(workers, index))
            env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
            env["CUDA_VISIBLE_DEVICES"] = ""
            # A file, not a pipe: a worker whose unread pipe filled up would
            # block, and the others with it in their next collective.
            outputs.append(tempfile.TemporaryFile())
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, *args],
                    cwd=ROOT,
                    env=env,
                    stdout=outputs[-1],
                    stderr=subprocess.STDOUT,
                )
            )
        results = []
        for process, output in zip(processes, outputs):
            process.wait(timeout=max(deadline - time.monotonic(), 1.0))
            output.seek(0)
            results.append((process.returncode, output.read().decode(errors="replace")))
        return results
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for output in outputs:
            output.close()
