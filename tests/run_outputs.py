"""A run's outputs as tests compare them: measured times and its own directory left out."""

import json

from trainers.run import json_files

# Measured times and the run's own directory: they differ between any two runs.
VARYING_KEYS = frozenset({"seconds", "wall_time_s", "images_per_sec", "model_dir"})


def without_varying(value):
    """`value` (parsed JSON) without the `VARYING_KEYS` of its dicts, at any depth."""
    if isinstance(value, dict):
        return {k: without_varying(v) for k, v in value.items() if k not in VARYING_KEYS}
    if isinstance(value, list):
        return [without_varying(v) for v in value]
    return value


def reject_constant(constant):
    """`json.loads`' `parse_constant` of strict JSON: NaN, Infinity and -Infinity raise."""
    raise ValueError(f"{constant} is not strict JSON")


def read_strict_json(path):
    """The JSON file at `path`, parsed strictly (a bare NaN or Infinity raises `ValueError`).

    The trainers write each non-finite number as null and list it under
    "non_finite_values" (`trainers.run.json_files`); those are put back.
    """
    with open(path) as f:
        json.loads(f.read(), parse_constant=reject_constant)
    return json_files.read_json(path, None)


def read_json(path):
    """The JSON file at `path` (strict, non-finite numbers put back), `without_varying`."""
    return without_varying(read_strict_json(path))
