"""Switching an existing Keras model to `keras_bn.BatchNormalization`."""

import inspect

import keras
import numpy as np

from keras_bn.batch_normalization import BatchNormalization


def convert_batch_norm(model, **overrides):
    """Returns a copy of `model` whose batch norms are `keras_bn` layers.

    Every `keras.layers.BatchNormalization` in `model`, in nested models too,
    becomes a `keras_bn.BatchNormalization` with the same configuration
    (Keras' arguments all exist here with the same meaning) and the same
    weights, moving statistics included; `overrides` are then applied to
    each of them, and to any `keras_bn.BatchNormalization` already in the
    model. Every other layer is cloned with its weights. The original model
    is not changed and shares no variable with the copy. Called inside a
    `tf.distribute` strategy's scope, the copy's variables belong to that
    strategy (like PyTorch's `SyncBatchNorm.convert_sync_batchnorm`, but
    returning a new model).

    Args:
        model: a built `keras.Sequential` or functional `keras.Model`.
        **overrides: `keras_bn.BatchNormalization` arguments applied to every
            converted layer, e.g. `synchronized=True`, `sync_group_size=8`,
            `unbiased_variance=True`, `momentum=None`.

    With `momentum=None` among the overrides the converted layers start the
    exact cumulative average afresh (`moving_batches` = 0): their first
    training batch replaces the copied moving statistics.

    Returns:
        The converted model; in inference mode its outputs equal `model`'s.

    Raises:
        TypeError: if `model` is not a Keras model, or an override is not an
            argument of `keras_bn.BatchNormalization`.
        ValueError: if `model` is subclassed (it cannot be cloned layer by
            layer) or not built, or an override value is invalid.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"convert_batch_norm needs a Keras model. Received: model={type(model).__name__}"
        )
    if not hasattr(model, "inputs"):  # Only Sequential/functional models have graph inputs.
        raise ValueError(
            "convert_batch_norm needs a Sequential or functional model; a subclassed "
            "model cannot be cloned layer by layer (build it functionally, or "
            "construct it with keras_bn layers). "
            f"Received: model={type(model).__name__}"
        )
    if not model.built:
        raise ValueError(f"convert_batch_norm needs a built model. Received: model={model.name}")
    accepted = set(inspect.signature(BatchNormalization.__init__).parameters) - {"self", "kwargs"}
    accepted |= {"name", "dtype", "trainable"}
    unknown = sorted(set(overrides) - accepted)
    if unknown:
        raise TypeError(
            f"{unknown} are not keras_bn.BatchNormalization arguments. "
            f"Received: overrides={overrides!r}"
        )
    # Invalid values fail here, before anything is cloned.
    BatchNormalization(**{k: v for k, v in overrides.items() if k != "name"})

    def clone(layer):
        if isinstance(layer, keras.Model):
            return keras.models.clone_model(layer, clone_function=clone)
        if isinstance(layer, (keras.layers.BatchNormalization, BatchNormalization)):
            config = layer.get_config()
            config.update(overrides)
            return BatchNormalization.from_config(config)
        return layer.__class__.from_config(layer.get_config())

    converted = keras.models.clone_model(model, clone_function=clone)
    _copy_weights(model, converted)
    return converted


def _copy_weights(source, target):
    """Copies every layer's weights into the same-named layer of the clone."""
    for layer in source.layers:
        if not layer.weights:
            continue
        twin = target.get_layer(layer.name)
        if isinstance(layer, keras.Model):
            _copy_weights(layer, twin)
        elif isinstance(twin, BatchNormalization):
            # By name: gamma, beta, the moving statistics and renorm's.
            mine = {w.name: w for w in twin.weights}
            for weight in layer.weights:
                if weight.name in mine:
                    # A NumPy copy: assigning the source array itself can
                    # share its buffer (JAX), which training the original
                    # (fit donates buffers) would then delete.
                    value = np.array(keras.ops.convert_to_numpy(weight), copy=True)
                    mine[weight.name].assign(value.astype(mine[weight.name].dtype))
        elif layer.weights:
            twin.set_weights(layer.get_weights())
