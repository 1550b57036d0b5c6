"""Stopping a run on SIGTERM or SIGINT at the next safe point, its work checkpointed.

SIGTERM is the notice preemptible VMs and TPU pods give before they kill a
job; SIGINT is a Ctrl-C. In a trainer's process either one only asks it to
stop, from the first line of the trainer's module (`defer_from_start`) to
its exit (`program.run` keeps them deferred). The run acts on the request
at the next safe point:

- during start-up (imports, the engine, data checks, the model, the
  restore): once the run has restored its checkpoint, before its first step;
- while training: after the compiled call the signal arrives in, committing
  and checkpointing the step reached (an evaluation's commit if it ends an
  interval, else the interval's sums so far, so a relaunch resumes
  mid-interval exactly);
- during an evaluation: after it and its commit;
- during the end-of-run writes (the end's summaries, `summary.json`, the
  figures): after them (the next run of the invocation, if any, stops at its
  start).

It then ends with one line and the status a signal gives: 143 for SIGTERM,
130 for SIGINT. A second Ctrl-C after a stop was asked stops at once
(`KeyboardInterrupt`; during the imports, before the trainer can report
where it stood, the process exits with status 130 and one line), losing the
steps since the last checkpoint; Python runs a handler once for signals that
arrive while a compiled call runs, so two Ctrl-Cs within one call ask once.
"""

import contextlib
import os
import signal
import threading

# The requests in force: a trainer's from its start (`defer_from_start`), or the outermost
# `deferred` block's.
_PROCESS = None


class StopRequests:
    """While installed (in the main thread), SIGTERM and SIGINT ask the run to stop.

    Attributes:
        signal: the first stop signal received (a `signal.Signals`), or None.
        unwinds: whether a second Ctrl-C may raise `KeyboardInterrupt` (inside
            `program.run`, which turns it into one line); else it exits the
            process at once with status 130 and one line.
    """

    CAUGHT = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal = None
        self.unwinds = True
        self._previous = {}

    def _handle(self, signum, frame):
        del frame
        if self.signal is not None and signum == signal.SIGINT:
            if self.unwinds:
                raise KeyboardInterrupt  # A Ctrl-C after a stop was asked: stop now.
            # Not `print`: the handler may interrupt a write to standard error.
            os.write(2, b"interrupted while starting; relaunch the same command\n")
            os._exit(130)
        self.signal = self.signal or signal.Signals(signum)

    def install(self):
        # Python runs signal handlers in the main thread only.
        if threading.current_thread() is threading.main_thread():
            previous = {s: signal.signal(s, self._handle) for s in self.CAUGHT}
            self._previous = self._previous or previous  # Installed again: the first ones.
        return self

    def uninstall(self):
        for signum, handler in self._previous.items():
            # A handler installed from C (None) cannot be put back: the
            # default, ending the process, takes its place.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous = {}

    def __enter__(self):
        return self.install()

    def __exit__(self, *unused_exc_info):
        self.uninstall()


def reclaim():
    """Installs the requests in force again, after a runtime took SIGTERM over from C.

    TensorFlow's multi-worker runtime (its coordination service's preemption
    notifier) and JAX's preemption service install their own SIGTERM handler
    in C++, which only records the signal for an API the trainers do not use:
    a preemption notice would be lost. Call it right after such a runtime
    starts. Python's own view of the handler never changed, so the handler
    is set again whatever `signal.getsignal` says.
    """
    if _PROCESS is not None:
        _PROCESS.install()


def defer_from_start():
    """Defers SIGTERM and SIGINT for the rest of this process (a trainer run as a program).

    Call it before the trainer's imports, which take seconds: a signal
    meanwhile is a request the run acts on once started.
    """
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = StopRequests().install()
        _PROCESS.unwinds = False


@contextlib.contextmanager
def deferred():
    """SIGTERM and SIGINT ask the run to stop inside the block; yields the `StopRequests`.

    Inside another such block, or in a trainer's process (`defer_from_start`),
    the requests already deferred are the ones yielded (a signal before the
    block counts); else (a trainer called in a test's process) the handlers
    are installed for the block only.
    """
    global _PROCESS
    if _PROCESS is not None:
        unwinds, _PROCESS.unwinds = _PROCESS.unwinds, True
        try:
            yield _PROCESS
        finally:
            _PROCESS.unwinds = unwinds
        return
    with StopRequests() as stops:
        _PROCESS = stops
        try:
            yield stops
        finally:
            _PROCESS = None


class Stopped(KeyboardInterrupt):
    """A run stopped on a signal at `step`, its work checkpointed (or why not).

    A `KeyboardInterrupt`, so no `except Exception` on its way out swallows
    it; `program.one_line_errors` prints it and exits with `exit_status`.
    """

    def __init__(self, name, step, signal_received, saved):
        super().__init__(name, step, signal_received, saved)
        self.name, self.step, self.saved = name, step, saved
        self.signal = signal_received
        self.exit_status = 128 + int(signal_received)  # The shell's status for the signal.

    def __str__(self):
        if not self.saved:
            saved = "no checkpoint saved (the state is not finite)"
        else:
            saved = "checkpoint saved" if self.step else "nothing trained yet"
        return (
            f"{self.name}: stopped at step {self.step} on {self.signal.name}; {saved}; "
            "relaunch the same command to resume"
        )
