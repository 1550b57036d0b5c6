"""Launching MultiWorkerMirroredStrategy worker processes on 127.0.0.1.

Each worker is `python -m MODULE ARGS...` in its own process with its own
TF_CONFIG. Ports are picked free by the OS, but another process may take one
between the pick and the worker binding it, so a launch whose worker reports
an address clash is retried with new ports. Every process is killed in
`finally`, and each wait is bounded.
"""

import json
import os
import socket
import subprocess
import sys

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


def run_workers(module, args_per_worker, timeout_s, env=None, attempts=3):
    """Runs one worker per entry of `args_per_worker`; returns their outputs.

    Args:
        module: the module each worker runs with `python -m`.
        args_per_worker: a list with each worker's extra arguments.
        timeout_s: the bound on the whole launch, per attempt.
        env: extra environment variables for every worker.
        attempts: launches tried when a worker reports a port clash.

    Returns:
        A list of `(returncode, output)`, one per worker.
    """
    results = _launch(module, args_per_worker, timeout_s, env or {})
    for _ in range(attempts - 1):
        if not _port_clash(results):
            break
        results = _launch(module, args_per_worker, timeout_s, env or {})
    return results


def _port_clash(results):
    return any(code != 0 and any(c in out for c in _CLASH) for code, out in results)


def _launch(module, args_per_worker, timeout_s, extra_env):
    workers = [f"127.0.0.1:{port}" for port in free_ports(len(args_per_worker))]
    processes = []
    try:
        for index, args in enumerate(args_per_worker):
            env = dict(os.environ)
            env.update(extra_env)
            env["TF_CONFIG"] = json.dumps(
                {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
            )
            env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
            env["CUDA_VISIBLE_DEVICES"] = ""
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, *args],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
        results = []
        for process in processes:
            output, _ = process.communicate(timeout=timeout_s)
            results.append((process.returncode, output.decode(errors="replace")))
        return results
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
