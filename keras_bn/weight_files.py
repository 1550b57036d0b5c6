"""A layer's weight-file entries: Keras' numbered keys, then its own state by name.

Keras' `BatchNormalization` saves its weights under the keys "0", "1", ... in
its order (γ, β, moving mean and variance, renorm's statistics), so a layer
that keeps those keys reads Keras' files and writes files Keras reads. The
state Keras' layer lacks is saved under its own name, which Keras' layer does
not read, and a file without it loads as zeros.
"""

import numpy as np


def save(store, keras_weights, own_state):
    """Writes `keras_weights` (a list) under "0", "1", ... and `own_state` (name → variable)."""
    for i, variable in enumerate(keras_weights):
        store[str(i)] = variable
    for name, variable in own_state.items():
        store[name] = variable


def load(store, keras_weights, own_state, own_names, layer_name):
    """Reads a file written by `save` or by Keras' layer into the variables given.

    Args:
        store: the file's entries for one layer.
        keras_weights: the layer's variables in Keras' order.
        own_state: name → variable of the layer's own state; each reads its
            entry, or zeros when the file has none.
        own_names: every name own state may have in a file (a file of a
            layer with other settings may hold state this one lacks).
        layer_name: the layer's name, for the error.

    Raises:
        ValueError: when the file's numbered entries differ in number or
            shape from `keras_weights`, or it holds an unknown key; the
            variables are then unchanged.
    """
    keys = list(store.keys())
    numbered = [str(i) for i in range(len(keras_weights))]
    values = [store[k] for k in numbered if k in keys]
    pairs = list(zip(values, keras_weights))
    pairs += [(store[name], v) for name, v in own_state.items() if name in keys]
    if sorted(set(keys) - set(own_names)) != sorted(numbered) or any(
        tuple(value.shape) != tuple(v.shape) for value, v in pairs
    ):
        raise ValueError(
            f"Layer '{layer_name}' expects the weights {[v.name for v in keras_weights]} of "
            f"shapes {[tuple(v.shape) for v in keras_weights]} under the keys "
            f"0..{len(keras_weights) - 1}, and {list(own_names)} by name; the file was saved "
            "from a layer of other settings or inputs. "
            f"Received: keys={keys}, shapes={[tuple(v.shape) for v in values]}"
        )
    for variable, value in zip(keras_weights, values):
        variable.assign(value)
    for name, variable in own_state.items():
        variable.assign(store[name] if name in keys else np.zeros(variable.shape, variable.dtype))
