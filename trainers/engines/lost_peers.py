"""What a multi-process run does when it loses a peer: it ends in one line.

The line names the peer that was lost (where the engine says which), this
process, the engine's own words, and the relaunch that resumes: "Relaunch
every worker with the same command: it resumes from the last checkpoint,
step S (path)". `reporting` gives the context a trainer's `main` runs in.

- A `tf.distribute.MultiWorkerMirroredStrategy` worker sees the loss as a
  TensorFlow error from its next collective.
- A process of a multi-process JAX job (`keras.distribution.initialize`)
  sees it as a `JaxRuntimeError` from its next cross-process collective
  (gloo's connection reset), or not at all: JAX's distributed client ends
  the process from a C++ thread (a `LOG(FATAL)` dump, then an abort) once
  the coordination service is gone or reports a lost process, and gloo
  aborts it (`std::terminate`) when a connection dies mid-transfer. So on JAX
  file descriptor 2 goes through a watcher process (this module run as a
  program) that passes every line on and, should the process abort so,
  prints the one line instead of the dump; the abort itself then ends the
  process with status 1, as every other one-line ending does, not with
  SIGABRT's 134 (`_exit_1_on_abort`), and a process still running 20 s
  after its dump (an abort handler that could not run) is SIGKILLed by the
  watcher, so none hangs. The Python-visible error ends the
  process at once (`_end_process`): JAX's exit would wait at its shutdown
  barrier for the lost peer, then abort.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import traceback

from absl import logging

from trainers.reporting import console

_JOB_ADDRESSES = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
_NUM_PROCESSES = "KERAS_DISTRIBUTION_NUM_PROCESSES"
_PROCESS_ID = "KERAS_DISTRIBUTION_PROCESS_ID"
# The line JAX's client prints before it aborts the process, from C++.
_JAX_FATAL = b"Terminating process because the JAX distributed service detected fatal errors"
# gloo's own abort, when a peer's connection dies in the middle of a transfer.
_GLOO_ABORT = b"terminate called after throwing an instance of 'gloo::"
# What a gloo collective says of a gone peer, and what the coordination service says.
_GLOO_PEER_GONE = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Connection refused",
    "Broken pipe",
)
_SERVICE_PEER_GONE = ("heartbeat timeout", "Failed to send RPC to coordination service")
# The end of a fatal message: the C++ stack, or Python's dump, follows.
_DUMP_ENDS = (b"*** Check failure stack trace: ***", b"Fatal Python error: ")
# JAX's note just before that line, which says no more than the line.
_FATAL_NOTE = b"Polled an error from coordination service"


def reporting(engine, distribution_strategy, program, model_dir):
    """The context that ends a multi-process run that lost a peer in one line.

    Wrap everything from the runner's creation on (steps, evaluations and
    checkpoint saves all run collectives), inside `program.one_line_errors`.
    Outside a multi-worker TensorFlow run or a multi-process JAX job nothing
    is turned. `program` starts the line the watcher prints; `model_dir` is
    where the last checkpoint is found.
    """
    if engine == "jax" and int(os.environ.get(_NUM_PROCESSES, "1")) > 1:
        return _reporting_lost_processes(program, model_dir)
    if distribution_strategy == "multi_worker_mirrored":
        return _reporting_lost_workers(model_dir)
    return contextlib.nullcontext()


class WorkerLostError(Exception):
    """A worker of a multi-worker TensorFlow run was lost: one line naming it, how to resume."""


@contextlib.contextmanager
def _reporting_lost_workers(model_dir):
    import tensorflow as tf

    # What a survivor's collectives raise once a peer has gone: its connection
    # reset or refused (Unavailable), the coordination service's missed
    # heartbeats (Unavailable, or the abort as Cancelled/Aborted), a timeout.
    peer_errors = (
        tf.errors.UnavailableError,
        tf.errors.DeadlineExceededError,
        tf.errors.CancelledError,
        tf.errors.AbortedError,
        tf.errors.InternalError,
    )
    try:
        yield
    except peer_errors as error:
        # An InternalError is also what a bug raises: only an aborted collective is a loss.
        if isinstance(error, tf.errors.InternalError) and "collective" not in error.message.lower():
            raise
        raise WorkerLostError(_lost_worker_message(error, model_dir)) from error


_ABORTED = "Collective ops is aborted"


def _lost_worker_message(error, model_dir):
    """Which task was lost (TensorFlow's error names it, TF_CONFIG its address), how to resume."""
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster = resolver.cluster_spec()
    tasks = [(job, i) for job in cluster.jobs for i in cluster.task_indices(job)]
    this = (resolver.task_type, resolver.task_id)
    name = lambda task: f"{task[0]} {task[1]} ({cluster.task_address(*task)})"
    named = re.findall(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)", error.message)
    lost = sorted({(job, int(i)) for job, i in named} & set(tasks) - {this})
    if lost:
        who = f"lost {', '.join(map(name, lost))} of this job"
    else:  # Not every error names the peer: list the job rather than guess.
        job = ", ".join(map(name, tasks))
        who = f"lost a worker of this job ({job}; TensorFlow does not say which)"
    # TensorFlow's own words: its collective's abort, where a compiled
    # function's error buries it under "Graph execution error:", else its
    # first line (and the next, which a line ending in ":" introduces);
    # without "{{function_node ...}}" prefixes.
    lines = [line.strip() for line in re.sub(r"\{\{.*?\}\}", "", error.message).splitlines()]
    lines = [line for line in lines if line] or ["?"]
    first = next((i for i, line in enumerate(lines) if line.startswith(_ABORTED)), 0)
    cause = " ".join(lines[first : first + (2 if lines[first].endswith(":") else 1)])[:200]
    checkpoint = _last_checkpoint(model_dir)
    resume = _resume(checkpoint, model_dir)
    return (
        f"{who}; this is {name(this)}, which stops too (TensorFlow: {cause}). "
        f"Relaunch every worker with the same command: {resume}."
    )


def _resume(checkpoint, model_dir):
    """What a relaunch does: resume from `checkpoint` (`(step, path)`), or start over if None."""
    if checkpoint is None:
        return f"no checkpoint is in --model_dir={model_dir} yet, so it starts over"
    return f"it resumes from the last checkpoint, step {checkpoint[0]} ({checkpoint[1]})"


def _last_checkpoint(model_dir):
    """`(step, prefix)` of the newest chief checkpoint under `model_dir`, or None.

    The newest by time, not step: `--variant=all` and MNIST's networks and
    seeds each checkpoint into their own `<run>/checkpoints`.
    """
    import tensorflow as tf

    from trainers.run import checkpoints

    found = [
        (tf.io.gfile.stat(prefix + ".index").mtime_nsec, step, prefix)
        for directory, _, _ in tf.io.gfile.walk(model_dir)
        if os.path.basename(directory.rstrip("/")) == "checkpoints"
        for step, prefix in checkpoints.checkpoint_prefixes(directory)
    ]
    if not found:
        return None
    _, step, prefix = max(found)
    return step, prefix


@contextlib.contextmanager
def _reporting_lost_processes(program, model_dir):
    import jax

    from trainers.run import preemption

    job = _JaxJob.from_environment()
    watcher = _StderrWatcher.start(program, model_dir, job)
    restore_abort = _exit_1_on_abort() if watcher is not None else None
    try:
        try:
            yield
        except preemption.Stopped:  # A stop every process agreed on: they leave together.
            jax.distributed.shutdown()
            raise
        # A run that ended leaves with its peers, here rather than at exit: a
        # peer lost at JAX's shutdown barrier is then one line, not an abort
        # (status 134) after the watcher has gone. A process leaving on its
        # own ends at once instead (`leave_job`).
        jax.distributed.shutdown()
    # JAX raises a failed collective as its runtime error, or (gloo's, from
    # `multihost_utils`) as a ValueError with the same words.
    except (jax.errors.JaxRuntimeError, ValueError) as error:
        # Only once the job has formed: a coordinator never reached is no lost peer.
        if not (jax.distributed.is_initialized() and _peer_gone(str(error))):
            raise
        _end_process(f"{program}: error: {job.lost_message(str(error), model_dir)}", watcher)
    finally:
        if restore_abort is not None:
            restore_abort()
        if watcher is not None:
            watcher.close()


# The abort handlers of a process leaving its job (`leave_job`), kept alive until it ends.
_KEPT = []


def leave_job(ending):
    """Ends this process at once if `ending` takes it out of a multi-process JAX job early.

    At exit, JAX's distributed client waits at a shutdown barrier for every
    process of the job (5 minutes), then aborts with a dump (status 134). A
    process that stops on its own, on a second Ctrl-C or an error only it
    met, would wait there while its peers wait for it in their next
    collective. So a process leaving with another status than 0 ends at
    once, skipping exit handlers as `_end_process` does: its peers see it
    gone and end in one line. A run that ends well, or a stop all processes
    agreed on, leaves by the barrier with its peers (the caller's choice).
    Where peers leave at once together, the slower one may see the
    coordinator gone first: JAX's abort then ends it with status 1 too.
    Outside a multi-process JAX job this does nothing.

    Args:
        ending: the exception ending the process: a `SystemExit` (its code a
            status, or the line to print with status 1) or another (its
            traceback printed, status 1).
    """
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized():
        return
    if isinstance(ending, SystemExit) and ending.code in (None, 0):
        return
    _KEPT.append(_exit_1_on_abort())  # Installed until the process ends.
    if not isinstance(ending, SystemExit):
        traceback.print_exception(ending)
        code = 1
    elif isinstance(ending.code, int):
        code = ending.code
    else:
        print(ending.code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_1_on_abort():
    """Makes an abort (SIGABRT) end this process with status 1 (see the module docstring).

    JAX's distributed client aborts from one of its C++ threads once its
    fatal message and stack are written (the watcher turns them into the one
    line); Python cannot replace that reaction (JAX's API takes no callback),
    and a Python signal handler runs too late, in the main thread. So a C
    handler (a ctypes callback) exits at once, skipping exit handlers as
    `_end_process` does. Returns the function that puts the previous handler back.
    """
    import ctypes

    handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)
    handler = handler_type(lambda signum: os._exit(1))
    libc = ctypes.CDLL(None)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    previous = libc.signal(signal.SIGABRT, ctypes.cast(handler, ctypes.c_void_p))

    def restore():
        libc.signal(signal.SIGABRT, previous)

    restore.handler = handler  # The callback lives while it is installed.
    return restore


def _peer_gone(text):
    """Whether JAX's error `text` says a peer of the job is gone."""
    gloo = "Gloo" in text and any(mark in text for mark in _GLOO_PEER_GONE)
    return gloo or any(mark in text for mark in _SERVICE_PEER_GONE)


def _end_process(line, watcher):
    """Says `line` and ends the process at once (status 1), skipping its exit handlers.

    JAX's would wait at its shutdown barrier for the lost peer, then abort
    with a dump. With a `watcher`, descriptor 2 is detached from the console
    first, so that a fatal dump JAX's client starts meanwhile cannot reach it.
    """
    print(console.one_line(line), file=sys.stderr, flush=True)
    sys.stdout.flush()
    if watcher is not None:
        watcher.detach()
    os._exit(1)


class _JaxJob:
    """This process's place in a multi-process JAX job (Keras' environment variables)."""

    def __init__(self, this, processes, coordinator):
        self.this = this
        self.processes = processes
        self.coordinator = coordinator

    @classmethod
    def from_environment(cls):
        # Without the id, JAX found the job itself (a TPU pod, SLURM): -1 for unknown.
        this = int(os.environ.get(_PROCESS_ID, "-1"))
        addresses = os.environ.get(_JOB_ADDRESSES, "?").split(",")
        return cls(this, int(os.environ[_NUM_PROCESSES]), addresses[0])

    def name(self, process):
        if process == 0:
            return f"process 0 (the coordinator, {self.coordinator})"
        return f"process {process}" if process >= 0 else "a process"

    def lost_message(self, text, model_dir):
        """The one line for JAX's `text` (an error or its fatal dump) in this process."""
        if "Failed to send RPC to coordination service" in text:
            lost = [0]  # Only the coordinator's own process holds the service.
        else:
            named = re.findall(r"Task (\d+) heartbeat timeout", text)
            lost = sorted({int(n) for n in named} - {self.this})
        if not lost and self.processes == 2 and self.this >= 0:
            lost = [1 - self.this]
        if "terminate called after throwing" in text:  # gloo's abort names no peer.
            who = (
                "a collective with the other processes aborted in gloo, as when a process of "
                "this job is lost mid-transfer"
            )
        elif lost:
            who = f"lost {', '.join(map(self.name, lost))} of this job"
        else:
            who = (
                f"lost a process of this job ({self.processes} processes, coordinator "
                f"{self.coordinator}; JAX does not say which)"
            )
        # The first sentence of JAX's status (or of gloo's `what()`): what failed.
        status = " ".join(re.split(r"absl::Status: |what\(\): ", text, maxsplit=1)[-1].split())
        cause = status.split(". ", 1)[0][:200]
        checkpoint = _last_orbax_checkpoint(model_dir)
        resume = _resume(checkpoint, model_dir)
        if checkpoint is None and "://" in model_dir:  # Not listed from here.
            resume = f"it resumes from the newest checkpoint in --model_dir={model_dir}"
        return (
            f"{who}; this is {self.name(self.this)}, which stops too (JAX: {cause}). "
            f"Relaunch every process with the same command: {resume}."
        )


def _last_orbax_checkpoint(model_dir):
    """`(step, path)` of the newest committed orbax step under `model_dir`, or None.

    Newest by time, as `_last_checkpoint`; orbax commits a step by renaming
    its temporary directory to the bare step number. A step deleted meanwhile
    (orbax keeps the newest few) is passed over.
    """
    found = []
    for directory, names, _ in os.walk(model_dir):
        if os.path.basename(directory) == "checkpoints":
            for name in filter(str.isdigit, names):
                with contextlib.suppress(FileNotFoundError):
                    mtime = os.stat(os.path.join(directory, name)).st_mtime_ns
                    found.append((mtime, int(name), directory))
    if not found:
        return None
    _, step, directory = max(found)
    return step, os.path.join(directory, str(step))


class _StderrWatcher:
    """Passes file descriptor 2 through the watcher process (`_watch`) until `close`."""

    def __init__(self, process):
        self._process = process
        self._original = os.dup(2)
        os.dup2(process.stdin.fileno(), 2)
        process.stdin.close()  # Descriptor 2 is now the pipe's only write end here.

    @classmethod
    def start(cls, program, model_dir, job):
        """The watcher of this process's descriptor 2, or None if it cannot start."""
        sys.stderr.flush()
        # The checkout holding `trainers`, wherever this process was started.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", __name__, program, model_dir]
                + [str(job.this), str(job.processes), job.coordinator, str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=2,
                env=dict(os.environ, PYTHONPATH=path),
                # Its own session: a Ctrl-C or SIGTERM for this process's
                # group is this process's to handle; the watcher ends at EOF.
                start_new_session=True,
            )
        except OSError as error:
            logging.warning("No watcher of standard error (%s): JAX's aborts show whole.", error)
            return None
        return cls(process)

    def detach(self):
        """Points descriptor 2 at /dev/null and waits for the watcher to pass the rest on.

        Not closed: a file opened meanwhile would take its number.
        """
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)  # Closes the pipe's last write end here: the watcher ends.
        self._wait()

    def close(self):
        sys.stderr.flush()
        os.dup2(self._original, 2)  # Closes the pipe: the watcher passes the rest on and ends.
        os.close(self._original)
        self._wait()

    def _wait(self):
        # Longer only if a child process holds the pipe too: the lines are passed on by then.
        try:
            self._process.wait(timeout=3)
        except subprocess.TimeoutExpired:
            self._process.kill()


# How long the watched process may still run once its fatal dump is whole: its abort
# ends it at once (`_exit_1_on_abort`); one that hangs instead is killed.
_AFTER_DUMP_S = 20


def _watch(program, model_dir, job, lines, out, watched=None):
    """Passes `lines` on to `out` (a binary file); a fatal JAX dump becomes the one line.

    The line goes out once the fatal message is whole (a stack begins), or at
    the end: not only when the pipe closes, which a child process of the
    watched one holding it open would delay. Once the line is out, the
    `watched` process (a pid) is SIGKILLed if it still runs `_AFTER_DUMP_S`
    later: an abort that hangs (the C handler waiting for Python's lock)
    never holds the job.
    """
    dump = None
    said = False  # Whether the process said the loss itself (`_end_process`).
    for line in lines:
        if dump is not None:
            dump.append(line)
            if any(end in line for end in _DUMP_ENDS) and not said:
                said = _say(program, model_dir, job, dump, out)
                if watched is not None:
                    timer = threading.Timer(_AFTER_DUMP_S, _kill, (watched,))
                    timer.daemon = True  # The pipe's end (the process's) ends the watcher.
                    timer.start()
        elif _JAX_FATAL in line or _GLOO_ABORT in line:
            dump = [line]
        elif _FATAL_NOTE not in line:
            said = said or b": error: lost " in line
            out.write(line)
            out.flush()
    if dump is not None and not said:
        _say(program, model_dir, job, dump, out)


def _kill(pid):
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _say(program, model_dir, job, dump, out):
    text = b"".join(dump).decode(errors="replace")
    out.write(f"{program}: error: {job.lost_message(text, model_dir)}\n".encode())
    out.flush()
    return True


if __name__ == "__main__":
    # The watcher outlives the process it watches, so that it can still say
    # how that process ended; it ends when the pipe closes. It runs in a
    # session of its own: signals for the watched process's group miss it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _program, _model_dir, _this, _processes, _coordinator, *_watched = sys.argv[1:]
    _job = _JaxJob(int(_this), int(_processes), _coordinator)
    _pid = int(_watched[0]) if _watched else None
    _watch(_program, _model_dir, _job, sys.stdin.buffer, sys.stdout.buffer, _pid)
