"""The trainers' input errors, and the one line a person sees for them.

Bad flags, --model_dir or data raise an `InputError` (or a subclass); a
trainer's `main` runs inside `one_line_errors`, which ends the process with
one line on stderr instead of a traceback. So do a corrupt record met while
training (named by `data_checks`) and a Ctrl-C.
"""

import contextlib
import sys

from trainers.reporting import console


class InputError(ValueError):
    """Bad flags, --model_dir or data: reported as one line, without a traceback."""


class MissingDataError(InputError, FileNotFoundError):
    """A data set that is not (completely) where the flags say."""


class CorruptDataError(InputError):
    """A data file whose content is not what its data set's info says."""


@contextlib.contextmanager
def one_line_errors(program):
    """Turns an `InputError` raised inside into `program: error: ...` on stderr, exit status 1.

    So too TensorFlow's `DataLossError`, a corrupt record met while reading
    data: the line names which of the files given to
    `data_checks.reads_data_files` holds it. A Ctrl-C ends in one line too,
    exit status 130: where the run stood and its last checkpoint
    (`console.Interrupted`), or only that it was interrupted.
    """
    try:
        yield
    except InputError as error:
        sys.exit(f"{program}: error: {one_line(error)}")
    except console.Interrupted as interrupted:
        print(f"{program}: {interrupted}", file=sys.stderr)
        sys.exit(130)  # The shell's status for a Ctrl-C.
    except KeyboardInterrupt:
        print(f"{program}: interrupted; relaunch the same command to resume", file=sys.stderr)
        sys.exit(130)
    except _data_loss_errors() as error:
        from trainers.run import data_checks  # It raises this module's errors: imported here.

        named = data_checks.name_corrupt_file(error)
        if named is None:
            raise  # Not from the data files: a traceback says more than a guess.
        sys.exit(f"{program}: error: {one_line(named)}")


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
