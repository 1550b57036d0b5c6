"""Helpers for tests that call absl `main` functions under pytest."""

import contextlib

from absl import flags
from absl.testing import flagsaver

from flags import inception_flags as inception_flags
from flags import mnist_flags as mnist_flags
from flags import training_flags as training_flags

# Each trainer's own flags module, which holds its defaults of the shared training flags.
_OWN_FLAGS = {"trainers.mnist_sigmoid": mnist_flags, "trainers.inception_bn": inception_flags}


def ensure_parsed():
    """Parses absl flags with defaults when the runner (pytest) did not."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS(["pytest"], known_only=True)


@contextlib.contextmanager
def trainer_flags(trainer, **values):
    """`flagsaver.flagsaver(**values)` with `trainer`'s defaults of the shared training flags.

    The flags then hold the trainer's defaults, as when it runs as a program
    (its `__main__` block sets them; `config_from_flags` would fill them in
    anyway); all flags are restored on exit.
    """
    with flagsaver.flagsaver():
        training_flags.set_defaults(**_OWN_FLAGS[trainer.__name__].TRAINING_DEFAULTS)
        with flagsaver.flagsaver(**values):
            yield
