"""Launching the worker processes of a multi-process job on 127.0.0.1.

Each worker is `python -m MODULE ARGS...` in its own process with its own
cluster environment: TF_CONFIG for a MultiWorkerMirroredStrategy job
(`tf_config_env`), Keras' KERAS_DISTRIBUTION_* variables for a JAX
`keras.distribution` job (`keras_distribution_env`). Ports are picked free by
the OS, but another process may take one between the pick and the worker
binding it, so a launch whose worker reports an address clash is retried
with new ports. Every process is killed in `finally`, and the launch's waits
together are bounded. `started_workers` hands the running workers to a
test that acts on them (killing one) before they end.
"""

import contextlib
import dataclasses
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


def port_clash(returncode, output):
    """Whether a worker that ended with `returncode` and `output` failed to bind its port."""
    return returncode != 0 and any(c in output for c in _CLASH)


def _port_clash(results):
    return any(port_clash(code, out) for code, out in results)


def _launch(module, args_per_worker, timeout_s, extra_env, cluster_env):
    deadline = time.monotonic() + timeout_s
    with started_workers(module, args_per_worker, extra_env, cluster_env) as workers:
        for worker in workers:
            worker.process.wait(timeout=max(deadline - time.monotonic(), 1.0))
        return [(worker.process.returncode, worker.output()) for worker in workers]


@dataclasses.dataclass
class Worker:
    """A started worker: its process, its cluster address and the file of its output."""

    process: subprocess.Popen
    address: str
    file: object

    def output(self):
        """Everything the worker has written so far (stdout and stderr interleaved)."""
        # pread, not seek and read: the worker writes through the same file
        # offset, which a seek here would move under it.
        fd = self.file.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def wait_for(done, workers, timeout_s):
    """Waits until `done()` holds while every worker runs; False if one lost its port first.

    Raises:
        AssertionError: if a worker ended otherwise first, or `timeout_s` passed.
    """
    deadline = time.monotonic() + timeout_s
    while not done():
        for worker in workers:
            code = worker.process.poll()
            if code is not None:
                if port_clash(code, worker.output()):
                    return False
                raise AssertionError(f"A worker ended first ({code}):\n{worker.output()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"Not done within {timeout_s} s")
        time.sleep(0.1)
    return True


@contextlib.contextmanager
def started_workers(module, args_per_worker, extra_env=None, cluster_env=tf_config_env):
    """Starts one worker per entry of `args_per_worker` and yields their `Worker`s.

    No port clash is retried here (see `run_workers` and `port_clash`). On
    leaving, every worker still running is killed and the output files closed.
    """
    addresses = [f"127.0.0.1:{port}" for port in free_ports(len(args_per_worker))]
    workers = []
    try:
        for index, args in enumerate(args_per_worker):
            env = dict(os.environ)
            env.update(extra_env or {})
            env.update(cluster_env(addresses, index))
            env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
            env["CUDA_VISIBLE_DEVICES"] = ""
            # A file, not a pipe: a worker whose unread pipe filled up would
            # block, and the others with it in their next collective.
            file = tempfile.TemporaryFile()
            try:
                process = subprocess.Popen(
                    [sys.executable, "-m", module, *args],
                    cwd=ROOT,
                    env=env,
                    stdout=file,
                    stderr=subprocess.STDOUT,
                )
            except BaseException:
                file.close()
                raise
            workers.append(Worker(process, addresses[index], file))
        yield workers
    finally:
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.kill()
                worker.process.wait()
        for worker in workers:
            worker.file.close()
