"""A run's outputs as tests compare them: measured times and its own directory left out."""

import json

# Measured times and the run's own directory: they differ between any two runs.
VARYING_KEYS = frozenset({"seconds", "wall_time_s", "images_per_sec", "model_dir"})


def without_varying(value):
    """`value` (parsed JSON) without the `VARYING_KEYS` of its dicts, at any depth."""
    if isinstance(value, dict):
        return {k: without_varying(v) for k, v in value.items() if k not in VARYING_KEYS}
    if isinstance(value, list):
        return [without_varying(v) for v in value]
    return value


def read_json(path):
    """The JSON file at `path`, `without_varying`."""
    with open(path) as f:
        return without_varying(json.load(f))
