"""The trainers' input errors, and a full disk said once.

Bad flags, --model_dir or data raise an `InputError` (or a subclass), which
a trainer's `main` (`program.one_line_errors`) ends in one line on stderr
instead of a traceback. So does a full disk (`disk_full`), whose dozens of
tracebacks from orbax's writer threads are kept off the console
(`without_disk_full_noise`, `quiet_disk_full_in_threads`) so that the line
stands alone.
"""

import contextlib
import errno
import logging as std_logging
import os
import re
import sys
import threading
import time
import traceback

from absl import logging


class InputError(ValueError):
    """Bad flags, --model_dir or data: reported as one line, without a traceback."""


class MissingDataError(InputError, FileNotFoundError):
    """A data set that is not (completely) where the flags say."""


class CorruptDataError(InputError):
    """A data file whose content is not what its data set's info says."""


class Diverged(InputError):
    """Runs that diverged (`trainers.run.divergence`): their results are those of diverged runs."""


# What each storage error says (TensorFlow's and tensorstore's errors carry only the words).
_UNWRITABLE = {
    errno.ENOSPC: ("No space left on device", "free space there"),
    errno.EDQUOT: ("Disk quota exceeded", "free space there"),
    errno.EROFS: ("Read-only file system", "make it writable"),
}


def disk_full(error):
    """The one line for an error caused by a full disk (anywhere in its chain), or None."""
    return _storage_line(error, (errno.ENOSPC,))


def unwritable(error):
    """The one line for an error caused by a full disk, a spent quota or a read-only file
    system (anywhere in its chain), or None."""
    return _storage_line(error, tuple(_UNWRITABLE))


def _storage_line(error, codes):
    seen = error
    while seen is not None:
        text = str(seen)
        for code in codes:
            words, remedy = _UNWRITABLE[code]
            if getattr(seen, "errno", None) == code or words in text:
                path = getattr(seen, "filename", None) or next(
                    iter(re.findall(r'"(/[^"]+)"', text)), None
                )
                where = f" writing {path}" if path else ""
                return (
                    f"{words}{where}: {remedy} (or pass another --model_dir), then relaunch the "
                    "same command to resume from the last checkpoint."
                )
        seen = seen.__cause__ or seen.__context__
    return None


@contextlib.contextmanager
def without_disk_full_noise():
    """Passes what is written to file descriptor 2 (by Python or C threads) on, but for the
    lines of a full disk (`_NotTheDiskFull.MARKS`) and, if the save fails on one, its tracebacks.

    Orbax's writer threads print dozens of them (some from C, past Python's
    hooks), several threads at once, so their lines interleave; the save's
    own error says it in one line (`program.one_line_errors`). Lines pass on
    live until a traceback starts; from there on they are held until the
    save ends, then dropped if it failed on a full disk, else passed on.
    """
    sys.stderr.flush()
    original = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    held = []
    last_line = [time.monotonic()]  # When the forwarder last read a line.
    forwarder = threading.Thread(
        target=_forward, args=(read_end, original, held, last_line), daemon=True
    )
    forwarder.start()
    full = False
    try:
        yield
    except BaseException as error:
        full = disk_full(error) is not None
        raise
    finally:
        sys.stderr.flush()
        # After a full disk orbax's threads go on printing for a moment (their
        # callbacks into closed event loops): wait until they have been quiet.
        give_up = time.monotonic() + 3
        while full and time.monotonic() - last_line[0] < 0.5 < give_up - time.monotonic():
            time.sleep(0.05)
        os.dup2(original, 2)  # Closes the pipe's last write end: the forwarder sees its end.
        forwarder.join(timeout=10)
        if not full:
            _write_all(original, b"".join(held))
        os.close(original)


def _forward(read_end, out, held, last_line):
    """Copies lines from `read_end` to `out` until a traceback starts, then into `held`."""
    marks = [mark.encode() for mark in _NotTheDiskFull.MARKS]
    with os.fdopen(read_end, "rb") as lines:
        for line in lines:
            last_line[0] = time.monotonic()
            if any(mark in line for mark in marks):
                continue
            if held or line.startswith(b"Traceback (most recent call last):"):
                held.append(line)
            else:
                _write_all(out, line)


def _write_all(fd, data):
    while data:
        data = data[os.write(fd, data) :]


class _NotTheDiskFull(std_logging.Filter):
    """Drops the records and thread tracebacks orbax's threads leave after a full disk."""

    # Each thread's own failure, and its callbacks into event loops closed by then.
    MARKS = ("No space left on device", "Event loop is closed")

    def filter(self, record):
        text = record.getMessage() + (str(record.exc_info[1]) if record.exc_info else "")
        return not any(mark in text for mark in self.MARKS)


def quiet_disk_full_in_threads():
    """Keeps what orbax's writer threads print on a full disk off the console (once per process).

    Each of its threads logs or raises the same `No space left on device`
    (and, once its event loop is closed, `Event loop is closed`): dozens of
    tracebacks burying the one line that says it, which the save's own error
    becomes (`program.one_line_errors`). Records without those marks pass.
    """
    if isinstance(threading.excepthook, _QuietExcepthook):
        return
    quiet = _NotTheDiskFull()
    for handler in (logging.get_absl_handler(), *std_logging.getLogger().handlers):
        handler.addFilter(quiet)
    std_logging.getLogger("asyncio").addFilter(quiet)
    threading.excepthook = _QuietExcepthook(threading.excepthook)


def quiet_abandoned_reads():
    """Logs, instead of printing, what orbax's abandoned reads raise as they end (once per process).

    Orbax reads a checkpoint's arrays concurrently. When one read fails (a
    damaged checkpoint, which `checkpoints.restore_newest_readable` passes
    over in one line), the others are abandoned: each coroutine raises again
    when it is closed, and tensorstore's callbacks find orbax's event loop
    closed, seconds later; asyncio logs a task of them whose exception no
    one retrieved. Python prints each coroutine's and callback's as an
    unraisable exception, with a traceback, and asyncio's record has one too.
    Those are logged at debug level instead; any other unraisable exception
    goes to the hook there was, and asyncio's other records pass.
    """
    if not isinstance(sys.unraisablehook, _QuietUnraisableHook):
        sys.unraisablehook = _QuietUnraisableHook(sys.unraisablehook)
        std_logging.getLogger("asyncio").addFilter(_AbandonedReadTasks())


class _QuietUnraisableHook:
    """A `sys.unraisablehook` logging orbax's abandoned reads, passing on the rest."""

    def __init__(self, hook):
        self._hook = hook

    def __call__(self, unraisable):
        code = getattr(unraisable.object, "cr_code", None)  # A coroutine's.
        from_orbax = (
            code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename
        ) or _raised_in_orbax(unraisable.exc_value)
        loop_closed = isinstance(unraisable.exc_value, RuntimeError) and (
            "Event loop is closed" in str(unraisable.exc_value)
        )
        if from_orbax or loop_closed:
            logging.debug("An abandoned checkpoint read ended: %.200s", unraisable.exc_value)
        else:
            self._hook(unraisable)


class _AbandonedReadTasks(std_logging.Filter):
    """Turns asyncio's "Task exception was never retrieved" of an orbax read into a debug line."""

    def filter(self, record):
        error = record.exc_info[1] if record.exc_info else None
        if "exception was never retrieved" in record.getMessage() and _raised_in_orbax(error):
            logging.debug("An abandoned checkpoint read ended: %.200s", error)
            return False
        return True


def _raised_in_orbax(error):
    """Whether `error`, or an error it was raised from, passed through orbax's code."""
    while error is not None:
        frames = traceback.extract_tb(error.__traceback__)
        if any(f"{os.sep}orbax{os.sep}" in frame.filename for frame in frames):
            return True
        error = error.__cause__ or error.__context__
    return False


class _QuietExcepthook:
    """A `threading.excepthook` or `sys.excepthook` passing on all but `_NotTheDiskFull.MARKS`."""

    def __init__(self, hook):
        self._hook = hook

    def __call__(self, *args):
        value = args[0].exc_value if len(args) == 1 else args[1]  # threading's or sys's.
        if not any(mark in str(value) for mark in _NotTheDiskFull.MARKS):
            self._hook(*args)
