"""A trainer's process, from its parsed flags to its exit status: one frame for both `main`s.

`run` is the whole of a trainer's `main`: the config of the flags, the
checks of --model_dir, the run itself, and every way it can end. A bad flag,
--model_dir or data set (an `errors.InputError`, or absl's
`flags.ValidationError` while the flags become a config), a corrupt record
met in training, a full disk, a lost peer, a diverged run, a signal or a
Ctrl-C each end the process with one line on stderr (`one_line_errors`); a
bug still ends in its traceback.
"""

import contextlib
import sys

from absl import flags

from flags import distribution_flags as distribution_flags
from trainers.engines import lost_peers
from trainers.reporting import console
from trainers.run import data_checks
from trainers.run import errors
from trainers.run import model_dirs
from trainers.run import preemption


def run(program, trainer, argv, config_from_flags, train):
    """Runs `train(config)` on the config of the parsed flags; every known failure is one line.

    Args:
        program: the name that starts each line (`program: error: ...`).
        trainer: the module recorded in --model_dir (`model_dirs`).
        argv: what `app.run` passes on: the program and no other argument.
        config_from_flags: makes the run's frozen config; a
            `flags.ValidationError` it raises is a refused flag combination.
        train: trains `config`; returns its histories by run name (each
            checked for divergence once all have trained), or None.
    """
    console.quiet_libraries()
    # SIGTERM and SIGINT only ask the run to stop, in every phase (`preemption`).
    with preemption.deferred():
        with one_line_errors(program):
            if len(argv) > 1:
                raise errors.InputError(f"Unexpected arguments: {argv[1:]}")
            try:
                config = config_from_flags()
            except flags.ValidationError as error:  # A refused combination of flags.
                raise errors.InputError(str(error)) from None
        # From the runner on, a lost peer too ends the run in one line.
        try:
            with one_line_errors(program), config.reporting_lost_workers(program, config.model_dir):
                model_dirs.check_model_dir(config.model_dir, trainer)
                check_converged(train(config) or {})
        except BaseException as ending:
            # A JAX process leaving its job on its own ends now; a stop every
            # process agreed on (`preemption.Stopped`) leaves with the others.
            cause = ending.__context__ if isinstance(ending, SystemExit) else ending
            if not isinstance(cause, preemption.Stopped):
                lost_peers.leave_job(ending)
            raise


def claim(config, trainer, loop, runner):
    """Checks that `loop`'s batch and BN groups split `runner`'s replicas; the chief claims the dir.

    Called once the runner and the data checks have passed, before anything
    is written to --model_dir.
    """
    check_replicas(loop, runner.num_replicas)
    if runner.is_chief:
        model_dirs.claim_model_dir(config.model_dir, trainer)


def check_replicas(loop, num_replicas):
    """Raises `errors.InputError` if the batch or BN groups cannot split the replicas."""
    if loop.batch_size % num_replicas:
        raise errors.InputError(
            f"The global batch must split evenly over {num_replicas} replicas. "
            f"Received: batch_size={loop.batch_size}"
        )
    try:
        distribution_flags.check_sync_group_size(loop.sync_group_size, num_replicas)
    except ValueError as error:
        raise errors.InputError(str(error)) from None


def check_converged(histories):
    """Raises `errors.Diverged` naming the first of `histories` (name → history) that diverged."""
    diverged = {name: h["diverged"] for name, h in histories.items() if h.get("diverged")}
    if diverged:
        name, first = next(iter(diverged.items()))
        raise errors.Diverged(
            f"{len(diverged)} of {len(histories)} runs diverged ({name} at step "
            f"{first['step']}: {first['reason']}); their results are recorded as diverged."
        )


@contextlib.contextmanager
def one_line_errors(program):
    """Turns an `InputError` raised inside into `program: error: ...` on stderr, exit status 1.

    So too TensorFlow's `DataLossError`, a corrupt record met while reading
    data: the line names which of the files given to
    `data_checks.reads_data_files` holds it; and a lost multi-worker peer
    (`lost_peers.WorkerLostError`). A Ctrl-C ends in one line too, exit
    status 130: where the run stood and its last checkpoint
    (`console.Interrupted`), or only that it was interrupted; a run stopped
    on a signal (`preemption.Stopped`) with the signal's status. An error
    caused by a full disk, on either engine, is one line naming the file.
    """
    try:
        yield
    except (errors.InputError, lost_peers.WorkerLostError) as error:
        sys.exit(f"{program}: error: {console.one_line(error)}")
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
        full = errors.unwritable(error) or data_checks.name_corrupt_file(error)
        if full is None:
            raise  # A bug, or nothing this knows: a traceback says more than a guess.
        sys.exit(f"{program}: error: {console.one_line(full)}")
