"""Folding inference-mode batch normalization into the preceding layer."""

import keras
import numpy as np

from keras_bn.batch_normalization import BatchNormalization

# Layers whose kernel keeps the output features on its last axis, so that a
# per-output-feature scale folds into kernel[..., k].
_FOLDABLE = (
    keras.layers.Dense,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
)


@keras.saving.register_keras_serializable(package="keras_bn")
class FoldedBatchNorm(keras.layers.Layer):
    """The identity left where a batch norm was folded into its producer.

    It accepts the `training` and `mask` arguments the replaced layer was
    called with, so functional graphs clone unchanged, and passes masks on.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, inputs, training=None, mask=None):
        del training, mask  # The folded transform is already in the producer.
        return inputs

    def compute_output_shape(self, input_shape):
        return input_shape


def _graph(model):
    """`(callers, consumers)` of a Sequential or functional model's layers.

    Read from the model's public config: `callers[name]` lists, per call of
    the layer, the names of the layers whose outputs it was called on, and
    `consumers[name]` counts the uses of the layer's outputs (by other layers
    and as model outputs).
    """
    if isinstance(model, keras.Sequential):
        names = [layer.name for layer in model.layers]
        # One call each, on the previous layer's output (the first on the input).
        callers = {name: [[prev]] for prev, name in zip([None] + names, names)}
        return callers, {name: 1 for name in names}
    config = model.get_config()
    callers, consumers = {}, {}

    def history(value, out):
        if isinstance(value, dict):
            if value.get("class_name") == "__keras_tensor__":
                out.append(value["config"]["keras_history"][0])
            else:
                for item in value.values():
                    history(item, out)
        elif isinstance(value, (list, tuple)):
            for item in value:
                history(item, out)
        return out

    for layer in config["layers"]:
        calls = [history([node["args"], node["kwargs"]], []) for node in layer["inbound_nodes"]]
        callers[layer["name"]] = calls
        for name in (n for call in calls for n in call):
            consumers[name] = consumers.get(name, 0) + 1
    outputs = config["output_layers"]  # [name, node, index], or a list/dict of them.
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    elif outputs and not isinstance(outputs[0], (list, tuple)):
        outputs = [outputs]
    for name, *_ in outputs:
        consumers[name] = consumers.get(name, 0) + 1
    return callers, consumers


def _foldable_pairs(model):
    """Maps each foldable producer's name to the BN layer that follows it."""
    callers, consumers = _graph(model)
    pairs = {}
    for bn in model.layers:
        calls = callers.get(bn.name, [])
        if not isinstance(bn, BatchNormalization) or len(calls) != 1 or len(calls[0]) != 1:
            continue
        producer = model.get_layer(calls[0][0])
        if (
            type(producer) not in _FOLDABLE
            or producer.activation not in (None, keras.activations.linear)
            or len(callers.get(producer.name, [])) != 1
            or consumers.get(producer.name, 0) != 1
        ):
            continue
        rank = len(producer.output.shape)
        if isinstance(producer, keras.layers.Dense) or (producer.data_format == "channels_last"):
            channel_axis = rank - 1
        else:
            channel_axis = 1
        if bn.feature_axes == (channel_axis,):
            pairs[producer.name] = bn
    return pairs


def fold_batch_norm(model):
    """Returns an inference copy of `model` with batch norms folded away.

    Each `keras_bn.BatchNormalization` whose only input is a `Dense`,
    `Conv1D`, `Conv2D` or `Conv3D` layer with a linear activation, normalising
    that layer's output channels and being its only consumer, is folded into
    it, using the inference-mode transform
        s = γ / √(moving_variance + ε),
        W' = W · s (per output channel),   b' = (b − moving_mean) · s + β,
    and replaced by a `FoldedBatchNorm` identity layer. Nested Sequential and
    functional models are folded the same way, each on its own (a pair is
    folded when both layers are in the same model). The folded weights are
    computed in float64 and stored in each layer's own dtype, so a float64
    model stays float64. Every other layer is copied with its weights; the
    original model is left untouched and shares no variables with the copy.

    Args:
        model: a built `keras.Sequential` or functional `keras.Model`.

    Returns:
        A new model whose outputs equal `model(x, training=False)` up to
        the rounding of the model's dtype.

    Raises:
        ValueError: if `model` is not a built Sequential/functional model.
    """
    # Only Sequential and functional models have graph inputs (public API).
    if not isinstance(model, keras.Model) or not hasattr(model, "inputs"):
        raise ValueError(
            "fold_batch_norm needs a Sequential or functional model. "
            f"Received: model={type(model).__name__}"
        )
    if not model.built:
        raise ValueError(f"fold_batch_norm needs a built model. Received: model={model.name}")
    pairs = _foldable_pairs(model)
    folded_bns = {bn.name for bn in pairs.values()}

    def clone(layer):
        if layer.name in folded_bns:
            return FoldedBatchNorm(name=layer.name, dtype=layer.dtype_policy)
        if isinstance(layer, keras.Model) and hasattr(layer, "inputs"):
            return fold_batch_norm(layer)  # Folded and filled with its weights.
        config = layer.get_config()
        if layer.name in pairs:
            config["use_bias"] = True
        return layer.__class__.from_config(config)

    folded = keras.models.clone_model(model, clone_function=clone)
    for layer in model.layers:
        if layer.name in folded_bns or not layer.weights:
            continue  # Input layers have no weights and get new names.
        if isinstance(layer, keras.Model) and hasattr(layer, "inputs"):
            continue  # Its folded clone holds its weights already.
        target = folded.get_layer(layer.name)
        if layer.name in pairs:
            _fold_into(target, layer, pairs[layer.name])
        else:
            target.set_weights(layer.get_weights())
    return folded


def _fold_into(target, producer, bn):
    """Writes `producer`'s kernel and bias with `bn` folded in into `target`."""

    def value(variable):
        return np.asarray(keras.ops.convert_to_numpy(variable), np.float64)

    kernel = value(producer.kernel)
    bias = value(producer.bias) if producer.use_bias else np.zeros(kernel.shape[-1])
    scale = 1.0 / np.sqrt(value(bn.moving_variance) + bn.epsilon)
    if bn.scale:
        scale = scale * value(bn.gamma)
    offset = value(bn.beta) if bn.center else 0.0
    target.kernel.assign((kernel * scale).astype(target.kernel.dtype))
    target.bias.assign(((bias - value(bn.moving_mean)) * scale + offset).astype(target.bias.dtype))
