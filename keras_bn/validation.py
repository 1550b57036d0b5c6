"""Argument checks shared by every public entry point of `keras_bn`.

Each returns the coerced value or raises a `TypeError`/`ValueError` whose
message ends in `Received: name=value`, as Keras' own layers do.
"""

import numbers

import keras
from keras import ops


def boolean(name, value):
    """`value` if it is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"Expected `{name}` to be a bool. Received: {name}={value!r}")
    return value


def optional_bool(name, value):
    """`None`, or `value` if it is a bool."""
    return None if value is None else boolean(name, value)


def optional_int(name, value, minimum, why=""):
    """`None`, or `value` as an int >= `minimum`; `why` explains the bound."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"Expected `{name}` to be an int or None. Received: {name}={value!r}")
    if value < minimum:
        raise ValueError(f"Expected `{name}` >= {minimum}{why}. Received: {name}={value}")
    return int(value)


def positive_int(name, value):
    """`value` as an int >= 1 (bools and `None` are rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"Expected `{name}` to be a positive int. Received: {name}={value!r}")
    return int(value)


def axis(value):
    """An int or a non-empty list/tuple of ints, as a tuple of ints."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values or not all(
        isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in values
    ):
        raise TypeError(
            f"Expected `axis` to be an int or a non-empty list of ints. Received: axis={value!r}"
        )
    return tuple(int(a) for a in values)


def momentum(value, name="momentum", allow_none=True):
    """A float in [0, 1), or `None` where `allow_none`."""
    if value is None and allow_none:
        return None
    kind = "a float or None" if allow_none else "a float"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"Expected `{name}` to be {kind}. Received: {name}={value!r}")
    value = float(value)
    if not 0.0 <= value < 1.0:
        raise ValueError(
            f"Expected `{name}` in [0, 1){' or None' if allow_none else ''}. "
            f"Received: {name}={value}"
        )
    return value


def epsilon(value):
    """A float >= 0 (NaN is rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"Expected `epsilon` to be a float. Received: epsilon={value!r}")
    value = float(value)
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"Expected `epsilon` >= 0. Received: epsilon={value}")
    return value


_CLIPPING_KEYS = ("rmax", "rmin", "dmax")


def renorm_clipping(clipping, renorm):
    """Batch Renormalization's clipping dict (`{}` for none), `None` without renorm."""
    if clipping is None:
        return {} if renorm else None
    if not renorm:
        raise ValueError(
            "`renorm_clipping` only applies with renorm=True. "
            f"Received: renorm_clipping={clipping!r}, renorm=False"
        )
    if not isinstance(clipping, dict):
        raise TypeError(
            "Expected `renorm_clipping` to be a dict with keys among rmax, rmin, "
            f"dmax. Received: renorm_clipping={clipping!r}"
        )
    unknown = sorted(set(clipping) - set(_CLIPPING_KEYS))
    if unknown:
        raise ValueError(
            f"Received invalid keys for `renorm_clipping`: {unknown}; supported keys are "
            f"{list(_CLIPPING_KEYS)}. Received: renorm_clipping={clipping!r}"
        )
    for key, value in clipping.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
            raise TypeError(
                f"Expected `renorm_clipping[{key!r}]` to be a float. "
                f"Received: renorm_clipping={clipping!r}"
            )
    clipping = {key: float(value) for key, value in clipping.items()}
    if clipping.get("rmax", float("inf")) < clipping.get("rmin", 0.0):
        raise ValueError(
            "rmax should be greater than or equal to rmin in `renorm_clipping`. "
            f"Received: renorm_clipping={clipping!r}"
        )
    if clipping.get("dmax", 0.0) < 0.0:
        raise ValueError(
            "dmax should be non-negative in `renorm_clipping`. "
            f"Received: renorm_clipping={clipping!r}"
        )
    return clipping


def synchronized(value):
    """Whether moments are synchronised: a bool, `True` only where an engine merges them."""
    value = boolean("synchronized", value)
    backend = keras.backend.backend()
    if value and backend not in ("tensorflow", "jax", "torch"):
        raise ValueError(
            "synchronized=True needs TensorFlow's tf.distribute, JAX's keras.distribution or "
            f"torch.distributed and is not supported on the {backend} backend. "
            "Received: synchronized=True"
        )
    return value


def sync_group_size(value, synchronized):
    """Replicas per synchronised group: `None` or an int >= 1, only when synchronised."""
    value = optional_int("sync_group_size", value, 1)
    if value is not None and not synchronized:
        raise ValueError(
            "`sync_group_size` groups replicas for synchronised statistics and needs "
            f"synchronized=True. Received: sync_group_size={value}, synchronized=False"
        )
    return value


def virtual_batch_size(value, sync_group_size):
    """The normalisation batch in examples: `None` or an int >= 2, not with `sync_group_size`."""
    value = optional_int(
        "virtual_batch_size", value, 2, " (a ghost batch of one example has no spread to normalise)"
    )
    if value is not None and sync_group_size is not None:
        raise ValueError(
            "With synchronized=True, virtual_batch_size already says which replicas share "
            "statistics (groups of virtual_batch_size / per-replica batch); pass it or "
            f"sync_group_size. Received: virtual_batch_size={value}, "
            f"sync_group_size={sync_group_size}"
        )
    return value


def nonfinite_guard(skip_nonfinite_updates, count_skipped_updates):
    """`(skip_nonfinite_updates, count_skipped_updates)`: bools, counting only with the guard on."""
    skip = boolean("skip_nonfinite_updates", skip_nonfinite_updates)
    count = boolean("count_skipped_updates", count_skipped_updates)
    if count and not skip:
        raise ValueError(
            "count_skipped_updates counts the updates skip_nonfinite_updates skips, and needs "
            "it on. Received: count_skipped_updates=True, skip_nonfinite_updates=False"
        )
    return skip, count


def momentum_warmup(value, momentum):
    """Whether to warm the momentum up: a bool, only with a float momentum."""
    value = boolean("momentum_warmup", value)
    if value and momentum is None:
        raise ValueError(
            "momentum_warmup warms up a float momentum; momentum=None already is the exact "
            "cumulative average. Received: momentum_warmup=True, momentum=None"
        )
    return value


STATISTICS = ("batch_in_training", "batch", "moving")


def statistics(value, renorm):
    """Which statistics normalise: one of `STATISTICS`; renorm needs the default."""
    if not isinstance(value, str):
        raise TypeError(f"`statistics` must be a string. Received: statistics={value!r}")
    if value not in STATISTICS:
        raise ValueError(
            f"`statistics` must be one of {STATISTICS}. Received: statistics={value!r}"
        )
    if renorm and value != STATISTICS[0]:
        raise ValueError(
            "renorm=True corrects the batch statistics of training towards the moving ones, "
            f"and needs statistics='{STATISTICS[0]}'. Received: statistics='{value}', renorm=True"
        )
    return value


def accumulation_steps(value, statistics):
    """Micro-batches per update of the moving statistics: `None` or an int >= 2, not frozen."""
    value = optional_int("accumulation_steps", value, 2, " (1 is no accumulation: pass None)")
    if value is not None and statistics == "moving":
        raise ValueError(
            "accumulation_steps paces the updates of the moving statistics, which "
            "statistics='moving' freezes. "
            f"Received: accumulation_steps={value}, statistics='moving'"
        )
    return value


def mask_weights(x, mask, dtype):
    """A call's `mask` as 0/1 weights of `x`'s rank in `dtype`, or `None` without a mask."""
    if mask is None:
        return None
    expected = tuple(x.shape[:-1])
    mismatch = len(mask.shape) != len(expected) or any(
        m not in (None, 1, e) and e is not None for m, e in zip(mask.shape, expected)
    )
    if mismatch:
        raise ValueError(
            f"Expected `mask` of shape {expected} (the inputs' shape without their last "
            "axis, size-1 dimensions broadcasting). "
            f"Received: mask.shape={tuple(mask.shape)}, inputs.shape={tuple(x.shape)}"
        )
    mask = ops.convert_to_tensor(mask)  # Keras' meaning, any dtype: counts where non-zero.
    if keras.backend.standardize_dtype(mask.dtype) != "bool":
        mask = ops.not_equal(mask, ops.zeros_like(mask))
    return ops.expand_dims(ops.cast(mask, dtype), -1)
