"""The trainers' JSON files (history, summaries, tables): strict JSON, written atomically.

Each file is written whole or not at all, durably on a local disk
(`trainers.run.atomic_files`).

A diverged run's numbers can be NaN or infinite, which JSON has no token
for (Python's `json` writes bare `NaN`, which strict parsers reject). Each is
written as `null`, and the file's top-level `"non_finite_values"` maps its
JSON pointer (RFC 6901, e.g. "/evals/3/train_loss") to what it was ("nan",
"inf" or "-inf"); `read_json` puts the numbers back.
"""

import json
import math

import tensorflow as tf

from trainers.run import atomic_files

NON_FINITE = "non_finite_values"


def write_json(path, payload):
    """Writes `payload` as strict JSON, atomically: a kill never leaves half of it.

    Raises:
        ValueError: if `payload` holds a non-finite number and is not a dict
            (there is no top-level field to say why its `null`s are there).
    """
    found = {}
    strict = _strict(payload, "", found)
    if found:
        if not isinstance(strict, dict):
            raise ValueError(f"Non-finite numbers in a JSON list or value. Received: {found}")
        strict[NON_FINITE] = found
    write_text(path, json.dumps(strict, indent=2, sort_keys=True, allow_nan=False))


def _strict(value, pointer, found):
    """`value` with each non-finite float as None, noted in `found` by its JSON pointer."""
    if isinstance(value, float) and not math.isfinite(value):
        found[pointer] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return None
    if isinstance(value, dict):
        return {
            key: _strict(item, f"{pointer}/{_escape(key)}", found)
            for key, item in value.items()
            if not (pointer == "" and key == NON_FINITE)
        }
    if isinstance(value, (list, tuple)):
        return [_strict(item, f"{pointer}/{i}", found) for i, item in enumerate(value)]
    return value


def _escape(key):
    return str(key).replace("~", "~0").replace("/", "~1")


def write_text(path, text):
    """Writes `text` atomically (`atomic_files.write_text`): a kill never leaves half of it."""
    atomic_files.write_text(path, text)


def read_json(path, default):
    """The JSON at `path` (`default` if there is none), its non-finite numbers put back."""
    if not tf.io.gfile.exists(path):
        return default
    with tf.io.gfile.GFile(path) as f:
        payload = json.load(f)
    if isinstance(payload, dict):
        for pointer, text in payload.pop(NON_FINITE, {}).items():
            *parents, last = [
                part.replace("~1", "/").replace("~0", "~") for part in pointer.split("/")[1:]
            ]
            container = payload
            for part in parents:
                container = container[int(part) if isinstance(container, list) else part]
            container[int(last) if isinstance(container, list) else last] = float(text)
    return payload
