"""Population statistics recomputed after training (paper Algorithm 2)."""

import numpy as np

from keras_bn.batch_normalization import BatchNormalization


def batch_norm_layers(model):
    """Every `keras_bn.BatchNormalization` inside `model`, nested ones too."""
    return [
        layer
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if isinstance(layer, BatchNormalization)
    ]


class _Accumulator:
    """Count-weighted sums of one layer's batch means and variances."""

    def __init__(self, unbiased):
        self.unbiased = unbiased
        self.count = 0.0
        self.batches = 0
        self.mean_sum = 0.0
        self.variance_sum = 0.0

    def __call__(self, count, mean, variance):
        m = float(count)
        if m <= 0:
            return
        variance = np.asarray(variance, np.float64)
        if self.unbiased and m > 1:
            variance = variance * m / (m - 1.0)
        self.count += m
        self.batches += 1
        self.mean_sum = self.mean_sum + m * np.asarray(mean, np.float64)
        self.variance_sum = self.variance_sum + m * variance


def estimate_population_statistics(model, dataset, num_batches):
    """Recomputes every keras_bn layer's moving statistics from training data.

    After training, the network is run in training mode (batch statistics)
    over `num_batches` batches of `dataset` with all weights fixed, and each
    layer's inference statistics are set to the averages of Algorithm 2:

        E[x]   = Σ_B m_B μ_B / Σ_B m_B,
        Var[x] = Σ_B m_B v_B / Σ_B m_B,

    where m_B counts the values behind a batch's statistics and v_B is σ²_B,
    or m_B/(m_B − 1)·σ²_B for layers with `unbiased_variance=True`. Count
    weighting makes a short final batch count for what it holds; with equal
    batches it is the paper's plain average. Nothing else changes: the moving
    statistics the forward passes would have updated are restored before the
    estimates are written. Layers with `momentum=None` also get
    `moving_batches` set to the number of batches seen, so later training
    continues the same average. The passes run eagerly.

    Args:
        model: a Keras model containing `keras_bn.BatchNormalization` layers.
        dataset: an iterable of batches (e.g. `tf.data.Dataset`); a batch is
            the model input or a tuple whose first element is.
        num_batches: positive int, how many batches to use at most.

    Returns:
        A dict from each layer's `path` to its `(mean, variance)` float32
        NumPy arrays.

    Raises:
        ValueError: if `num_batches` is not a positive int, if the model has
            no keras_bn layer, or if the dataset yields no batch.
    """
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
        raise ValueError(
            f"Expected `num_batches` to be a positive int. Received: num_batches={num_batches!r}"
        )
    layers = batch_norm_layers(model)
    if not layers:
        raise ValueError(
            "The model contains no keras_bn.BatchNormalization layer. "
            f"Received: model={model.name}"
        )
    accumulators = [_Accumulator(layer.unbiased_variance) for layer in layers]
    saved = [
        [v.numpy() for v in layer.non_trainable_variables] for layer in layers
    ]
    try:
        for layer, accumulator in zip(layers, accumulators):
            layer._statistics_observer = accumulator
        seen = 0
        for batch in dataset:
            if seen == num_batches:
                break
            inputs = batch[0] if isinstance(batch, tuple) else batch
            model(inputs, training=True)
            seen += 1
    finally:
        for layer, values in zip(layers, saved):
            layer._statistics_observer = None
            for variable, value in zip(layer.non_trainable_variables, values):
                variable.assign(value)
    if seen == 0:
        raise ValueError("The dataset yielded no batch.")
    estimates = {}
    for layer, accumulator in zip(layers, accumulators):
        if accumulator.batches == 0:
            continue  # The layer never ran in training mode (e.g. frozen).
        mean = (accumulator.mean_sum / accumulator.count).astype(np.float32)
        variance = (accumulator.variance_sum / accumulator.count).astype(
            np.float32
        )
        layer.moving_mean.assign(mean)
        layer.moving_variance.assign(variance)
        if layer.moving_batches is not None:
            layer.moving_batches.assign(float(accumulator.batches))
        estimates[layer.path] = (mean, variance)
    return estimates
