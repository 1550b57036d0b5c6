"""Population statistics recomputed after training (paper Algorithm 2)."""

import keras
import numpy as np

from keras_bn import moving_statistics
from keras_bn import validation
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
    what training computes (v_B included); a feature the layer does not move
    for (a batch of one value per feature, or a non-finite one) leaves that
    batch out of its average. The averages are accumulated
    with the layers' update rule in its cumulative mode
    (`moving_statistics.update`, weight n_B); nothing else changes: every
    layer's momentum and non-trainable variables are restored before the
    estimates are written.
    Layers with frozen statistics (`statistics="moving"`) or not trainable
    keep theirs; `accumulation_steps` plays no part (every pass is read).
    Layers with `momentum=None` also get `moving_batches` set to the number
    of batches they moved for, so later training continues the same average. The passes
    are compiled once per call on TensorFlow (`tf.function`) and JAX
    (`jax.jit` of the model's `stateless_call`), and run eagerly on PyTorch:
    eager TensorFlow took about 0.6 s per batch-32 pass of the miniature
    BN-Inception on 2 CPU cores, most of it per-layer dispatch.

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
    num_batches = validation.positive_int("num_batches", num_batches)
    # Frozen statistics (`statistics="moving"`) stay as they are, as do a non-trainable layer's.
    layers = [b for b in batch_norm_layers(model) if b.trainable and b.statistics != "moving"]
    if not layers:
        raise ValueError(
            "The model contains no trainable keras_bn.BatchNormalization layer whose "
            f"statistics move. Received: model={model.name}"
        )
    saved = [[v.numpy() for v in layer.non_trainable_variables] for layer in layers]
    settings = [(layer.momentum, layer.accumulation_steps) for layer in layers]
    # Each layer's running population average, in float64 (float32 on JAX
    # without `jax_enable_x64`, ample over a few hundred batches): the rule's
    # cumulative mode with batch weights n_B (v_B arrives corrected already).
    rule = moving_statistics.Rule(momentum=None, unbiased_variance=False, epsilon=0.0)
    averages = [
        {"moving_mean": 0.0, "moving_variance": 0.0, "moving_batches": np.float64(0.0)}
        for _ in layers
    ]
    seen, used = 0, [0.0] * len(layers)  # Batches read; batches each layer moved for.
    try:
        for layer in layers:
            layer.momentum = 0.0  # The moving statistics become the batch's,
            layer.accumulation_steps = None  # at every pass.
        training_pass = _training_pass(model)  # Traced after the momentum is 0.
        for batch in dataset:
            if seen == num_batches:
                break
            inputs = batch[0] if isinstance(batch, tuple) else batch
            examples = float(keras.ops.shape(keras.tree.flatten(inputs)[0])[0])
            for i, (mean, variance, moved) in enumerate(
                _batch_moments(layers, training_pass, inputs)
            ):
                averages[i] = moving_statistics.update(
                    rule, averages[i], mean, variance, moved, weight=examples
                )
                used[i] += float(np.max(keras.ops.convert_to_numpy(moved)) > 0.0)
            seen += 1
    finally:
        for layer, values, (momentum, steps) in zip(layers, saved, settings):
            layer.momentum, layer.accumulation_steps = momentum, steps
            for variable, value in zip(layer.non_trainable_variables, values):
                variable.assign(value)
    if seen == 0:
        raise ValueError("The dataset yielded no batch.")
    estimates = {}
    for layer, average, batches in zip(layers, averages, used):
        dtype = layer.statistics_dtype
        mean = keras.ops.convert_to_numpy(average["moving_mean"]).astype(dtype)
        variance = keras.ops.convert_to_numpy(average["moving_variance"]).astype(dtype)
        layer.moving_mean.assign(mean)
        layer.moving_variance.assign(variance)
        if layer.renorm:
            layer.moving_stddev.assign(np.sqrt(variance + layer.epsilon).astype(dtype))
        if layer.moving_batches is not None:
            layer.moving_batches.assign(batches)
        estimates[layer.path] = (mean, variance)
    return estimates


def _batch_moments(layers, training_pass, inputs):
    """Each layer's `(mean, variance, count)` of one pass, in float64.

    The count is 2 (one the update rule moves for) where the layer moved,
    else 0: no variance is −1, so a feature still holding it after the pass
    did not move (one value or none, or a non-finite batch).
    """
    for layer in layers:
        layer.moving_variance.assign(np.full(layer.moving_variance.shape, -1.0))
    training_pass(inputs)
    moments = []
    for layer in layers:
        variance = _float64(layer.moving_variance)
        moved = np.where(keras.ops.convert_to_numpy(variance) >= 0.0, 2.0, 0.0).reshape(-1)
        count = keras.ops.convert_to_tensor(moved, variance.dtype)
        moments.append((_float64(layer.moving_mean), variance, count))
    return moments


def _training_pass(model):
    """One training-mode forward pass of `model` on `inputs`, its variables updated."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(lambda inputs: model(inputs, training=True))
    if backend == "jax":
        import jax

        @jax.jit
        def new_state(trainable, non_trainable, inputs):
            return model.stateless_call(trainable, non_trainable, inputs, training=True)[1]

        def run(inputs):
            values = new_state(
                [v.value for v in model.trainable_variables],
                [v.value for v in model.non_trainable_variables],
                keras.tree.map_structure(np.asarray, inputs),  # E.g. tf.data's tensors.
            )
            for variable, value in zip(model.non_trainable_variables, values):
                variable.assign(value)

        return run
    return lambda inputs: model(inputs, training=True)


def _float64(variable):
    """A variable's value as a float64 backend tensor (the rule mixes it with tensors)."""
    return keras.ops.convert_to_tensor(np.asarray(variable, np.float64))
