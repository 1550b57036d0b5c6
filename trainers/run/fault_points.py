"""Named points in a trainer's writes where the fault soak (`tests/soak.py`) strikes.

The trainers call `reach(point)` just before each write that a fault could
cut short: each atomic rename ("rename history.json"), each part of a
checkpoint save, each deletion of an old checkpoint, each evaluation, the
end-of-run writes. Unless the environment names a fault, `reach` returns at
once and does nothing: a trainer behaves the same with the hook and without
it.

Two environment variables, read once per process, turn it on:

- `KERAS_BN_FAULT`: a JSON list of faults `{"point": P, "count": N,
  "action": A}`, each with an optional `"delay_s"`: at the N-th time this
  process reaches P it sends itself the signal A ("SIGKILL", "SIGTERM",
  "SIGINT", "SIGSTOP"; with `delay_s` from a thread that waits that long
  first, so the fault lands inside the write that follows), or raises the
  `OSError` A names ("ENOSPC", "EROFS") as that write would.
- `KERAS_BN_FAULT_TRACE`: a file to which each point reached is appended as
  a line, the point and `time.monotonic()` (the system's clock) between tabs,
  flushed at once (the soak's record of where its faults can land).
"""

import errno
import json
import os
import signal
import threading
import time

_ENV = "KERAS_BN_FAULT"
_TRACE_ENV = "KERAS_BN_FAULT_TRACE"
_ERRORS = {"ENOSPC": errno.ENOSPC, "EROFS": errno.EROFS}
_SIGNALS = {"SIGKILL", "SIGTERM", "SIGINT", "SIGSTOP"}


class _Hook:
    """The faults and the trace this process's environment names (see the module docstring)."""

    def __init__(self, spec, trace_path):
        self.faults = json.loads(spec) if spec else []
        for fault in self.faults:
            action = fault.get("action")
            if action not in _SIGNALS | set(_ERRORS):
                raise ValueError(
                    f"{_ENV} names an unknown action. Expected one of "
                    f"{sorted(_SIGNALS | set(_ERRORS))}. Received: action={action!r}"
                )
        self.trace_path = trace_path
        self.counts = {}
        self.lock = threading.Lock()

    def reach(self, point):
        with self.lock:
            count = self.counts[point] = self.counts.get(point, 0) + 1
            if self.trace_path:
                with open(self.trace_path, "a") as trace:
                    trace.write(f"{point}\t{time.monotonic():.4f}\n")
        for fault in self.faults:
            if fault["point"] == point and fault["count"] == count:
                self._strike(fault)

    def _strike(self, fault):
        action, point = fault["action"], fault["point"]
        if action in _ERRORS:
            code = _ERRORS[action]
            raise OSError(code, os.strerror(code), f"(fault hook at {point})")
        signum = getattr(signal, action)
        delay = fault.get("delay_s", 0)
        if delay:
            timer = threading.Timer(delay, os.kill, (os.getpid(), signum))
            timer.daemon = True  # A process that ends first is not kept waiting for it.
            timer.start()
        else:
            os.kill(os.getpid(), signum)


_HOOK = None
if os.environ.get(_ENV) or os.environ.get(_TRACE_ENV):
    _HOOK = _Hook(os.environ.get(_ENV), os.environ.get(_TRACE_ENV))


def reach(point):
    """Marks `point` reached: a no-op unless the environment names a fault or a trace."""
    if _HOOK is not None:
        _HOOK.reach(point)
