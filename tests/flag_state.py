"""Helpers for tests that call absl `main` functions under pytest."""

from absl import flags


def ensure_parsed():
    """Parses absl flags with defaults when the runner (pytest) did not."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS(["pytest"], known_only=True)
