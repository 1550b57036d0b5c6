"""The fault soak's launches: a trainer's processes, each with its environment, watched to the end.

A launch of one worker is one process; of several, one process per worker
on 127.0.0.1 with its cluster environment (`tests.multi_worker`). Every
process writes its output to a file of its own, appends the fault points it
reaches to a trace file (`trainers.run.fault_points`), and has a temporary
directory of its own (`TMPDIR`), where the soak looks for what a worker left.
"""

import dataclasses
import os
import signal
import subprocess
import sys
import time

from tests import multi_worker

ROOT = multi_worker.ROOT


def unignore_signals():
    """Makes the trainers started from here see SIGINT and SIGTERM as a person's would.

    A background job or a test runner's worker may have them ignored, which
    a child process inherits; a handled one is reset to the default in the
    child. Call it in the main thread.
    """
    for signum, handler in (
        (signal.SIGINT, signal.default_int_handler),
        (signal.SIGTERM, signal.SIG_DFL),
    ):
        if signal.getsignal(signum) == signal.SIG_IGN:
            signal.signal(signum, handler)


@dataclasses.dataclass
class Process:
    """One worker's process of a launch."""

    worker: int
    popen: subprocess.Popen
    log: str
    trace: str
    tmp_dir: str
    started: float

    def output(self):
        with open(self.log, errors="replace") as f:
            return f.read()

    def _trace(self):
        if not os.path.exists(self.trace):
            return []
        with open(self.trace) as f:
            return [line.split("\t") for line in f.read().splitlines() if "\t" in line]

    def points(self):
        """The fault points this process reached, in order."""
        return [point for point, _ in self._trace()]

    def reached_at(self, hook):
        """When (`time.monotonic()`) this process reached the point and count `hook` names."""
        times = [float(t) for point, t in self._trace() if point == hook["point"]]
        return times[hook["count"] - 1]

    def running(self):
        return self.popen.poll() is None

    def stopped(self):
        """Whether the process is stopped (SIGSTOP), as /proc says."""
        try:
            with open(f"/proc/{self.popen.pid}/stat") as f:
                # The state follows the command's closing parenthesis.
                return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
        except (FileNotFoundError, IndexError):
            return False

    def send(self, signum):
        if self.running():
            self.popen.send_signal(signum)

    @property
    def code(self):
        """The exit status as a shell gives it: 128 + the signal that ended the process."""
        code = self.popen.returncode
        return None if code is None else (128 - code if code < 0 else code)


class Launch:
    """One launch of every worker of a run (started by `start`, ended by `wait`)."""

    def __init__(self, scenario, model_dir, log_dir, number, faults_by_worker):
        self.scenario = scenario
        self.model_dir = model_dir
        self.number = number
        self.faults_by_worker = faults_by_worker
        self.log_dir = log_dir
        self.processes = []

    def start(self):
        """Starts every worker; retried with new ports if a worker could not bind its own."""
        for _ in range(3):
            self._start_once()
            if not self._port_clash():
                return self
            self.kill()
        raise AssertionError(f"launch {self.number}: every try lost a port")

    def _start_once(self):
        workers = self.scenario.workers
        addresses = [f"127.0.0.1:{p}" for p in multi_worker.free_ports(workers)]
        self.processes = []
        for worker in range(workers):
            name = f"launch{self.number:03d}_worker{worker}"
            tmp_dir = os.path.join(self.log_dir, "tmp", f"worker{worker}")
            os.makedirs(tmp_dir, exist_ok=True)
            env = dict(os.environ)
            env.update(self.scenario.env())
            env["TMPDIR"] = tmp_dir
            env["KERAS_BN_FAULT_TRACE"] = os.path.join(self.log_dir, f"{name}.trace")
            env.pop("KERAS_BN_FAULT", None)
            faults = self.faults_by_worker.get(worker)
            if faults:
                import json

                env["KERAS_BN_FAULT"] = json.dumps(faults)
            if workers > 1:
                env.update(self.scenario.cluster_env(addresses, worker))
            env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
            log = os.path.join(self.log_dir, f"{name}.log")
            with open(log, "wb") as out:
                popen = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        self.scenario.module,
                        *self.scenario.args(self.model_dir),
                    ],
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            self.processes.append(
                Process(worker, popen, log, env["KERAS_BN_FAULT_TRACE"], tmp_dir, time.monotonic())
            )

    def _port_clash(self):
        if len(self.processes) < 2:
            return False
        deadline = time.monotonic() + 120
        # A clash shows within the first seconds, before the job forms.
        while time.monotonic() < deadline and all(p.running() for p in self.processes):
            if any(
                "Resumed from" in p.output() or "Global batch" in p.output() for p in self.processes
            ):
                return False
            time.sleep(0.2)
        return any(
            not p.running() and multi_worker.port_clash(p.popen.returncode, p.output())
            for p in self.processes
        )

    def running(self):
        return [p for p in self.processes if p.running()]

    def wait(self, timeout_s):
        """Waits for every worker to end; returns False if one still ran after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.running():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def kill(self):
        for process in self.processes:
            if process.running():
                process.popen.kill()
            process.popen.wait()
