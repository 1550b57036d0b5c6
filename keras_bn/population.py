"""Population statistics recomputed after training (paper Algorithm 2)."""

import keras
import numpy as np

from keras_bn.batch_normalization import BatchNormalization


def batch_norm_layers(model):
    """Every `keras_bn.BatchNormalization` in `model`, nested models included.

    Walks the public `layers` of `model` and of every layer that has layers
    of its own (nested `Sequential`/functional/subclassed models), depth
    first, each layer once.
    """
    found, seen = [], set()

    def visit(layer):
        if id(layer) in seen:
            return
        seen.add(id(layer))
        if isinstance(layer, BatchNormalization):
            found.append(layer)
        for child in getattr(layer, "layers", ()):
            visit(child)

    visit(model)
    return found


def estimate_population_statistics(model, dataset, num_batches):
    """Recomputes every keras_bn layer's moving statistics from training data.

    After training, the network is run in training mode (batch statistics)
    over `num_batches` batches of `dataset` with all weights fixed, and each
    layer's inference statistics are set to the averages of Algorithm 2:

        E[x]   = Σ_B n_B μ_B / Σ_B n_B,
        Var[x] = Σ_B n_B v_B / Σ_B n_B,

    where n_B is the number of examples in batch B and v_B is σ²_B, or
    m_B/(m_B − 1)·σ²_B for layers with `unbiased_variance=True` (m_B the
    values behind the statistic). Weighting by n_B makes a short final batch
    count for what it holds; when all batches share their other dimensions
    it is weighting by m_B, and with equal batches it is the paper's plain
    average. Each batch's statistics are read from the layers' own moving
    statistics after a pass with `momentum` set to 0, so they are exactly
    what training computes; nothing else changes: every layer's momentum and
    non-trainable variables are restored before the estimates are written.
    Layers with `momentum=None` also get `moving_batches` set to the number
    of batches seen, so later training continues the same average. The passes
    run eagerly.

    Args:
        model: a Keras model containing `keras_bn.BatchNormalization` layers.
        dataset: an iterable of batches (e.g. `tf.data.Dataset`); a batch is
            the model input or a tuple whose first element is.
        num_batches: positive int, how many batches to use at most.

    Returns:
        A dict from each layer's `path` to its `(mean, variance)` NumPy
        arrays, in the layer's statistics dtype.

    Raises:
        ValueError: if `num_batches` is not a positive int, if the model has
            no keras_bn layer, or if the dataset yields no batch.
    """
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
        raise ValueError(
            f"Expected `num_batches` to be a positive int. Received: num_batches={num_batches!r}"
        )
    layers = [layer for layer in batch_norm_layers(model) if layer.trainable]
    if not layers:
        raise ValueError(
            "The model contains no trainable keras_bn.BatchNormalization layer. "
            f"Received: model={model.name}"
        )
    saved = [[v.numpy() for v in layer.non_trainable_variables] for layer in layers]
    momenta = [layer.momentum for layer in layers]
    weight = 0.0
    sums = [[0.0, 0.0] for _ in layers]
    seen = 0
    try:
        for layer in layers:
            layer.momentum = 0.0  # The moving statistics become the batch's.
        for batch in dataset:
            if seen == num_batches:
                break
            inputs = batch[0] if isinstance(batch, tuple) else batch
            examples = float(keras.ops.shape(keras.tree.flatten(inputs)[0])[0])
            model(inputs, training=True)
            weight += examples
            for layer, total in zip(layers, sums):
                total[0] = total[0] + examples * np.asarray(layer.moving_mean, np.float64)
                total[1] = total[1] + examples * np.asarray(layer.moving_variance, np.float64)
            seen += 1
    finally:
        for layer, values, momentum in zip(layers, saved, momenta):
            layer.momentum = momentum
            for variable, value in zip(layer.non_trainable_variables, values):
                variable.assign(value)
    if seen == 0:
        raise ValueError("The dataset yielded no batch.")
    estimates = {}
    for layer, (mean_sum, variance_sum) in zip(layers, sums):
        dtype = layer.statistics_dtype
        mean = (mean_sum / weight).astype(dtype)
        variance = (variance_sum / weight).astype(dtype)
        layer.moving_mean.assign(mean)
        layer.moving_variance.assign(variance)
        if layer.renorm:
            layer.moving_stddev.assign(np.sqrt(variance + layer.epsilon).astype(dtype))
        if layer.moving_batches is not None:
            layer.moving_batches.assign(float(seen))
        estimates[layer.path] = (mean, variance)
    return estimates
