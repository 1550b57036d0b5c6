"""Stopping a run on SIGTERM or SIGINT at the next step boundary, its work checkpointed.

SIGTERM is the notice preemptible VMs and TPU pods give before they kill a
job; SIGINT is a Ctrl-C. While a run trains (`StopRequests`), either one
only asks it to stop: the skeleton checks between compiled calls, commits
the step reached (an evaluation's commit if it ends an interval, else the
interval's sums so far, so a relaunch resumes mid-interval exactly) and
ends with one line and the status a signal gives: 143 for SIGTERM, 130 for
SIGINT. A Ctrl-C after a stop was asked stops at once (`KeyboardInterrupt`),
losing the steps since the last checkpoint; Python runs a handler once for
signals that arrive while a compiled call runs, so two Ctrl-Cs within one
call ask once.
"""

import signal
import threading


class StopRequests:
    """While entered (in the main thread), SIGTERM and SIGINT ask the run to stop.

    Attributes:
        signal: the first stop signal received (a `signal.Signals`), or None.
    """

    CAUGHT = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal = None
        self._previous = {}

    def _handle(self, signum, frame):
        del frame
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # A Ctrl-C after a stop was asked: stop now.
        self.signal = self.signal or signal.Signals(signum)

    def __enter__(self):
        # Python runs signal handlers in the main thread only.
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.CAUGHT}
        return self

    def __exit__(self, *unused_exc_info):
        for signum, handler in self._previous.items():
            # A handler installed from C (None: under JAX the runtime's own
            # SIGTERM handler, which does not end the process) cannot be put
            # back: the default, ending the process, takes its place.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous = {}


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
        saved = (
            "checkpoint saved" if self.saved else "no checkpoint saved (the state is not finite)"
        )
        return (
            f"{self.name}: stopped at step {self.step} on {self.signal.name}; {saved}; "
            "relaunch the same command to resume"
        )
