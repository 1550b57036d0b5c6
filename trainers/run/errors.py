"""The trainers' input errors, and the one line a person sees for them.

Bad flags, --model_dir or data raise an `InputError` (or a subclass); a
trainer's `main` runs inside `one_line_errors`, which ends the process with
one line on stderr instead of a traceback. So do a corrupt record met while
training (named by `data_checks`), a run that diverged, a run stopped on
SIGTERM or SIGINT (`preemption`) and a Ctrl-C after a stop was asked.
"""

import contextlib
import errno
import re
import sys

from trainers.reporting import console
from trainers.run import preemption


class InputError(ValueError):
    """Bad flags, --model_dir or data: reported as one line, without a traceback."""


class MissingDataError(InputError, FileNotFoundError):
    """A data set that is not (completely) where the flags say."""


class CorruptDataError(InputError):
    """A data file whose content is not what its data set's info says."""


class Diverged(InputError):
    """Runs that diverged (`trainers.run.divergence`): their results are those of diverged runs."""


def check_converged(histories):
    """Raises `Diverged` naming the first of `histories` (name → history) that diverged."""
    diverged = {name: h["diverged"] for name, h in histories.items() if h.get("diverged")}
    if diverged:
        name, first = next(iter(diverged.items()))
        raise Diverged(
            f"{len(diverged)} of {len(histories)} runs diverged ({name} at step "
            f"{first['step']}: {first['reason']}); their results are recorded as diverged."
        )


@contextlib.contextmanager
def one_line_errors(program):
    """Turns an `InputError` raised inside into `program: error: ...` on stderr, exit status 1.

    So too TensorFlow's `DataLossError`, a corrupt record met while reading
    data: the line names which of the files given to
    `data_checks.reads_data_files` holds it. A Ctrl-C ends in one line too,
    exit status 130: where the run stood and its last checkpoint
    (`console.Interrupted`), or only that it was interrupted; a run stopped
    on a signal (`preemption.Stopped`) with the signal's status. An error
    caused by a full disk, on either engine, is one line naming the file.
    """
    try:
        yield
    except InputError as error:
        sys.exit(f"{program}: error: {one_line(error)}")
    except preemption.Stopped as stopped:
        print(f"{program}: {stopped}", file=sys.stderr)
        sys.exit(stopped.exit_status)
    except console.Interrupted as interrupted:
        print(f"{program}: {interrupted}", file=sys.stderr)
        sys.exit(130)  # The shell's status for a Ctrl-C.
    except KeyboardInterrupt:
        print(f"{program}: interrupted; relaunch the same command to resume", file=sys.stderr)
        sys.exit(130)
    except Exception as error:
        full = disk_full(error)
        if full is None and isinstance(error, _data_loss_errors()):
            from trainers.run import data_checks  # It raises this module's errors: imported here.

            full = data_checks.name_corrupt_file(error)
        if full is None:
            raise  # A bug, or nothing this knows: a traceback says more than a guess.
        sys.exit(f"{program}: error: {one_line(full)}")


def disk_full(error):
    """The one line for an error caused by a full disk (anywhere in its chain), or None."""
    seen = error
    while seen is not None:
        text = str(seen)
        if getattr(seen, "errno", None) == errno.ENOSPC or "No space left on device" in text:
            path = getattr(seen, "filename", None) or next(
                iter(re.findall(r'"(/[^"]+)"', text)), None
            )
            where = f" writing {path}" if path else ""
            return (
                f"No space left on device{where}: free space there (or pass another "
                "--model_dir), then relaunch the same command to resume from the last checkpoint."
            )
        seen = seen.__cause__ or seen.__context__
    return None


def _data_loss_errors():
    """TensorFlow's `DataLossError` once TensorFlow is imported (before, nothing raises it)."""
    tf = sys.modules.get("tensorflow")
    return (tf.errors.DataLossError,) if tf is not None else ()


def one_line(message, limit=None):
    """`message` (an error, or any text) on one line, cut to `limit` characters if given."""
    text = " ".join(str(message).split())  # One line, whatever the message held.
    if limit is not None and len(text) > limit:
        return text[:limit] + "..."
    return text
