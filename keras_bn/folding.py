"""Folding inference-mode batch normalization into the preceding layer."""

import keras
import numpy as np

from keras_bn.batch_normalization import BatchNormalization

_CONV = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
_TRANSPOSE = (
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
)
_DEPTHWISE = (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
_SEPARABLE = (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
# A BN after one of these folds into its output channels; before one of
# these (with "valid" padding, where no zero padding meets the BN's offset)
# into its input channels.
_PRODUCERS = (keras.layers.Dense, *_CONV, *_TRANSPOSE, *_DEPTHWISE, *_SEPARABLE)
_CONSUMERS = (keras.layers.Dense, *_CONV)


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

    def get_config(self):
        # Defined here, Keras' automatic config (which fails on the dtype
        # policy object it is given) is not used: the base arguments suffice.
        return super().get_config()


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


def _channel_axis(layer, rank):
    """The axis of `layer`'s channels in its rank-`rank` input or output."""
    if isinstance(layer, keras.layers.Dense) or layer.data_format == "channels_last":
        return rank - 1
    return 1


def _why_not_plain(layer, role):
    """Why `layer`'s kernel cannot take a fold (None if it can): quantized or with LoRA."""
    if getattr(layer, "quantization_mode", None):
        return f"{role} {layer.name} is quantized ({layer.quantization_mode})"
    if getattr(layer, "lora_enabled", False):
        return f"{role} {layer.name} has LoRA weights"
    return None


def _why_not_after(bn, name, layers, callers, consumers):
    """Why `bn` cannot fold into its input's layer `name` (None if it can)."""
    producer = layers.get(name)
    if name is None or isinstance(producer, keras.layers.InputLayer):
        return "its input is a model input"
    if producer is None:
        return f"its input comes from {name}, an operation"
    # Exact types: a subclass may transform its kernel in its own `call`.
    if type(producer) not in _PRODUCERS:
        return f"its input comes from {name} ({type(producer).__name__})"
    if producer.activation not in (None, keras.activations.linear):
        return f"its input {name} has activation {producer.activation.__name__}"
    if len(callers.get(name, [])) != 1 or consumers.get(name, 0) != 1:
        return f"its input {name} is called more than once or has other consumers"
    if bn.feature_axes != (_channel_axis(producer, len(producer.output.shape)),):
        return f"it does not normalise the channels of its input {name}"
    return _why_not_plain(producer, "its input")


def _why_not_before(bn, name, layers, callers):
    """Why `bn` cannot fold into `name`, the one consumer of its output (None if it can)."""
    consumer = layers.get(name)
    if name is None:
        return "its output has several consumers or is a model output"
    if consumer is None:
        return f"its output goes to {name}, an operation"
    if type(consumer) not in _CONSUMERS:
        return f"its output goes to {name} ({type(consumer).__name__})"
    if callers[name] != [[bn.name]]:
        return f"its consumer {name} is called more than once or on other inputs"
    if isinstance(consumer, _CONV) and (consumer.padding != "valid" or consumer.groups != 1):
        return f"its consumer {name} pads (its zeros would not be normalised) or groups"
    if bn.feature_axes != (_channel_axis(consumer, len(consumer.input.shape)),):
        return f"it does not normalise the input channels of its consumer {name}"
    return _why_not_plain(consumer, "its consumer")


def _plan(model):
    """`(after, before, reasons)`: the BN folded into each producer and consumer, by name.

    `reasons` says, for every keras_bn layer of `model` (not nested), where it
    folds or why it is kept (see `folding_plan`).
    """
    callers, consumers = _graph(model)
    layers = {layer.name: layer for layer in model.layers}  # Not a graph's operations.
    only_consumer = {}  # Of each output used once: the name of what uses it.
    for name, calls in callers.items():
        for source in {n for call in calls for n in call} - {None}:
            only_consumer[source] = name if consumers[source] == 1 else None
    after, before, reasons = {}, {}, {}
    for bn in model.layers:
        if not isinstance(bn, BatchNormalization):
            continue
        calls = callers.get(bn.name, [])
        if len(calls) != 1 or len(calls[0]) != 1:
            reasons[bn.name] = "kept: it is called more than once or on several inputs"
            continue
        if bn.statistics == "batch":  # Its inference is no fixed affine map.
            reasons[bn.name] = "kept: statistics='batch' normalises with batch statistics"
            continue
        producer, consumer = calls[0][0], only_consumer.get(bn.name)
        why_not_after = _why_not_after(bn, producer, layers, callers, consumers)
        why_not_before = _why_not_before(bn, consumer, layers, callers)
        if why_not_after is None:
            after[producer] = bn
            reasons[bn.name] = f"folded into {producer}, its input"
        elif why_not_before is None:
            before[consumer] = bn
            reasons[bn.name] = f"folded into {consumer}, its consumer"
        else:
            reasons[bn.name] = f"kept: {why_not_after}; {why_not_before}"
    return after, before, reasons


def folding_plan(model):
    """What `fold_batch_norm` does with each keras_bn layer of `model`, by layer name.

    A layer folds into its input's layer ("folded into NAME, its input")
    or, failing that, into its one consumer ("folded into NAME, its
    consumer"); else it is kept, and the value says why for both ("kept:
    its input conv has activation relu; its output goes to add (Add)").
    Layers of nested models are planned within their model (not listed).

    Args:
        model: a built `keras.Sequential` or functional `keras.Model`.

    Returns:
        A dict from each keras_bn layer's name to one line.

    Raises:
        ValueError: if `model` is not a built Sequential/functional model.
    """
    _check_model(model)
    return _plan(model)[2]


def _check_model(model):
    # Only Sequential and functional models have graph inputs (public API).
    if not isinstance(model, keras.Model) or not hasattr(model, "inputs"):
        raise ValueError(
            "fold_batch_norm needs a Sequential or functional model. "
            f"Received: model={type(model).__name__}"
        )
    if not model.built:
        raise ValueError(f"fold_batch_norm needs a built model. Received: model={model.name}")


def fold_batch_norm(model):
    """Returns an inference copy of `model` with batch norms folded away.

    With the inference-mode transform of a `keras_bn.BatchNormalization`,
    y = x·s + t where s = γ / √(moving_variance + ε) and t = β − moving_mean·s
    (per channel), a layer folds
    - into the linear layer it follows (its input's `Dense`, `Conv1D/2D/3D`,
      `Conv1D/2D/3DTranspose`, `DepthwiseConv1D/2D` or `SeparableConv1D/2D`,
      with a linear activation and no other consumer, whose output channels
      it normalises): W' = W·s per output channel (a depthwise kernel per
      input channel × multiplier, a separable one in its pointwise kernel),
      b' = (b − moving_mean)·s + β;
    - else into the linear layer that alone consumes it (a `Dense`, or a
      `Conv1D/2D/3D` with `padding="valid"` and no groups, whose input
      channels it normalises; padding would meet the offset t with zeros):
      W' = W·s per input channel, b' = b + Σ W·t;
    and is replaced by a `FoldedBatchNorm` identity layer. Only those exact
    classes take a fold (not subclasses, which may transform their kernel),
    and not when quantized or with LoRA weights. Every other keras_bn layer
    is kept, for the reason `folding_plan(model)` gives.
    Nested Sequential and functional models are folded the same way, each on
    its own. The folded weights are computed in float64 and stored in each
    layer's own dtype, so a float64 model stays float64. Every other layer is
    copied with its weights; the original model is left untouched and shares
    no variables with the copy.

    Args:
        model: a built `keras.Sequential` or functional `keras.Model`.

    Returns:
        A new model whose outputs equal `model(x, training=False)` up to
        the rounding of the model's dtype.

    Raises:
        ValueError: if `model` is not a built Sequential/functional model.
    """
    _check_model(model)
    after, before, _ = _plan(model)
    folded_bns = {bn.name for bn in (*after.values(), *before.values())}

    def clone(layer):
        if layer.name in folded_bns:
            return FoldedBatchNorm(name=layer.name, dtype=layer.dtype_policy)
        if isinstance(layer, keras.Model) and hasattr(layer, "inputs"):
            return fold_batch_norm(layer)  # Folded and filled with its weights.
        config = layer.get_config()
        if layer.name in after or layer.name in before:
            config["use_bias"] = True
        return layer.__class__.from_config(config)

    folded = keras.models.clone_model(model, clone_function=clone)
    for layer in model.layers:
        if layer.name in folded_bns or not layer.weights:
            continue  # Input layers have no weights and get new names.
        if isinstance(layer, keras.Model) and hasattr(layer, "inputs"):
            continue  # Its folded clone holds its weights already.
        target = folded.get_layer(layer.name)
        if layer.name in after or layer.name in before:
            _fold_into(target, layer, before.get(layer.name), after.get(layer.name))
        else:
            target.set_weights(layer.get_weights())
    return folded


def _value(variable):
    return np.asarray(keras.ops.convert_to_numpy(variable), np.float64)


def _affine(bn):
    """`(s, t)` of `bn`'s inference transform x·s + t, per channel, in float64."""
    scale = 1.0 / np.sqrt(_value(bn.moving_variance) + bn.epsilon)
    if bn.scale:
        scale = scale * _value(bn.gamma)
    offset = _value(bn.beta) if bn.center else 0.0
    return scale, offset - _value(bn.moving_mean) * scale


def _fold_into(target, layer, bn_before, bn_after):
    """Writes `layer`'s weights into `target` with `bn_before` and `bn_after` (or None) folded."""
    separable = isinstance(layer, _SEPARABLE)
    kernel = _value(layer.pointwise_kernel if separable else layer.kernel)
    channels = kernel.shape[-2] if isinstance(layer, _TRANSPOSE) else kernel.shape[-1]
    if isinstance(layer, _DEPTHWISE):
        channels = kernel.shape[-2] * kernel.shape[-1]
    bias = _value(layer.bias) if layer.use_bias else np.zeros(channels)
    if bn_before is not None:  # Input channels: the kernel's axis -2 (Dense, Conv).
        scale, shift = _affine(bn_before)
        bias = bias + (kernel * shift[:, None]).reshape(-1, kernel.shape[-1]).sum(0)
        kernel = kernel * scale[:, None]
    if bn_after is not None:
        scale, shift = _affine(bn_after)
        if isinstance(layer, _DEPTHWISE):  # Output channel c·multiplier + m.
            kernel = kernel * scale.reshape(kernel.shape[-2:])
        elif isinstance(layer, _TRANSPOSE):  # Kernel (..., filters, inputs).
            kernel = kernel * scale[:, None]
        else:
            kernel = kernel * scale
        bias = bias * scale + shift
    weights = {"bias": bias, ("pointwise_kernel" if separable else "kernel"): kernel}
    for name, value in weights.items():
        variable = getattr(target, name)
        variable.assign(value.astype(variable.dtype))
    if separable:
        target.depthwise_kernel.assign(layer.depthwise_kernel)
