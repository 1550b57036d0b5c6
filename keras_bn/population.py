"""Population statistics recomputed after training (paper Algorithm 2)."""

import keras
import numpy as np

from keras_bn import torch_replicas
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
    batch out of its average. Nothing else changes: every layer's momentum
    and non-trainable variables are restored before the estimates are
    written. Layers with frozen statistics (`statistics="moving"`) or not
    trainable keep theirs; `accumulation_steps` plays no part (every pass is
    read). Layers with `momentum=None` also get `moving_batches` set to the
    number of batches they moved for, so later training continues the same
    average.

    Several replicas pool their batches, each batch B of each replica
    weighing n_B as above, so the estimate is the one process's over the
    same batches (each replica's batch is a batch here, the global batch
    with `synchronized=True`), and every replica gets it:

    - under a `tf.distribute` strategy (call it inside the strategy's
      scope), each global batch of `dataset` is split over the replicas as
      `fit` splits it (`experimental_distribute_dataset`; a distributed
      dataset is taken as it is, other batches are split evenly over the
      replicas of the worker reading them), and the replicas' sums are
      all-reduced after each pass;
    - under JAX's `keras.distribution` the layers see the global batch and
      pool their replicas' moments themselves (equal slices of it);
    - under `torch.distributed`, each rank reads its own `dataset` (its
      shard), and the ranks' sums are all-reduced once at the end: every
      rank must call this with the same `num_batches` and have that many
      batches (synchronised layers all-reduce in every pass).

    The passes are compiled once per call on TensorFlow (`tf.function`) and
    JAX (`jax.jit` of the model's `stateless_call`), and run eagerly on
    PyTorch: eager TensorFlow took about 0.6 s per batch-32 pass of the
    miniature BN-Inception on 2 CPU cores, most of it per-layer dispatch.

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
    replicas = _replicas()
    # Per layer and feature, in float64: Σ n_B, Σ n_B μ_B and Σ n_B v_B over the
    # batches it moved for, and per layer the batches it moved for.
    sums = [np.zeros((3, int(np.prod(layer.moving_mean.shape)))) for layer in layers]
    seen, used = 0, np.zeros(len(layers))
    try:
        for layer in layers:
            layer.momentum = 0.0  # The moving statistics become the batch's,
            layer.accumulation_steps = None  # at every pass.
        training_pass = replicas.training_pass(model, layers)  # Traced after the momentum is 0.
        for inputs in replicas.batches(dataset):
            if seen == num_batches:
                break
            for layer in layers:  # −1: no variance; a feature still holding it did not move.
                layer.moving_variance.assign(np.full(layer.moving_variance.shape, -1.0))
            for i, batch_sums in enumerate(training_pass(inputs)):
                sums[i] += batch_sums
                used[i] += float(np.any(batch_sums[0] > 0.0))
            seen += 1
    finally:
        for layer, values, (momentum, steps) in zip(layers, saved, settings):
            layer.momentum, layer.accumulation_steps = momentum, steps
            for variable, value in zip(layer.non_trainable_variables, values):
                variable.assign(value)
    sums, seen, used = replicas.total(sums, seen, used)
    if seen == 0:
        raise ValueError("The dataset yielded no batch.")
    estimates = {}
    for layer, (weight, mean_sum, variance_sum), batches in zip(layers, sums, used):
        dtype, shape = layer.statistics_dtype, layer.moving_mean.shape
        weight = np.where(weight > 0.0, weight, 1.0)  # A feature never moved: 0 / 1.
        mean = (mean_sum / weight).reshape(shape).astype(dtype)
        variance = (variance_sum / weight).reshape(shape).astype(dtype)
        layer.moving_mean.assign(mean)
        layer.moving_variance.assign(variance)
        if layer.renorm:
            layer.moving_stddev.assign(np.sqrt(variance + layer.epsilon).astype(dtype))
        if layer.moving_batches is not None:
            layer.moving_batches.assign(batches)
        estimates[layer.path] = (mean, variance)
    return estimates


def _pass_sums(layers, rows, read, moved):
    """Each layer's `[n·moved, n·moved·μ, n·moved·v]` per feature after one pass.

    `read(variable)` is its value as a flat float64 array (a replica's copy
    inside a `tf.distribute` replica), `moved(variance)` 1.0 where the
    layer moved and 0.0 where the pass left the −1, and `rows` the pass's
    examples.
    """
    out = []
    for layer in layers:
        mean, variance = read(layer.moving_mean), read(layer.moving_variance)
        weight = rows * moved(variance)
        out.append([weight, weight * mean, weight * variance])
    return out


def _examples(inputs):
    return float(keras.ops.shape(keras.tree.flatten(inputs)[0])[0])


def _replicas():
    """How this process's passes meet other replicas' (see `estimate_population_statistics`)."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        if tf.distribute.has_strategy():
            return _TFReplicas(tf.distribute.get_strategy())
    if backend == "torch":
        replicas = torch_replicas.current()
        if replicas is not None:
            return _TorchRanks(replicas)
    return _OneProcess()


class _OneProcess:
    """One process, one model replica (JAX's distribution pools its replicas in the layers)."""

    @staticmethod
    def batches(dataset):
        for batch in dataset:
            yield batch[0] if isinstance(batch, tuple) else batch

    def training_pass(self, model, layers):
        """`run(inputs)`: one training-mode pass; each layer's sums (`_pass_sums`), NumPy."""
        step = _training_pass(model)

        def run(inputs):
            step(inputs)
            sums = _pass_sums(layers, _examples(inputs), _flat_float64, _moved)
            return [np.stack(s) for s in sums]

        return run

    @staticmethod
    def total(sums, seen, used):
        return sums, seen, used


class _TorchRanks(_OneProcess):
    """The ranks of `torch.distributed`: each reads its own data; sums meet at the end."""

    def __init__(self, replicas):
        self.replicas = replicas

    def total(self, sums, seen, used):
        flat = np.concatenate([s.reshape(-1) for s in sums] + [[seen], used])
        flat = torch_replicas.sum_over_ranks(flat)
        out, start = [], 0
        for s in sums:
            out.append(flat[start : start + s.size].reshape(s.shape))
            start += s.size
        # Batches read over every rank (none anywhere: no batch); batches each layer moved
        # for: each rank's own, their mean over the ranks.
        ranks = self.replicas.num_replicas_in_sync
        return out, int(flat[start]), np.round(flat[start + 1 :] / ranks)


class _TFReplicas:
    """A `tf.distribute` strategy's replicas: each global batch split, sums reduced per pass."""

    def __init__(self, strategy):
        self.strategy = strategy

    def batches(self, dataset):
        import tensorflow as tf

        strategy = self.strategy
        if isinstance(dataset, tf.data.Dataset):
            dataset = strategy.experimental_distribute_dataset(dataset)
        elif not isinstance(dataset, tf.distribute.DistributedDataset):
            dataset = (_split(strategy, b) for b in dataset)
        for batch in dataset:
            yield batch[0] if isinstance(batch, tuple) else batch

    def training_pass(self, model, layers):
        import tensorflow as tf

        strategy = self.strategy

        def replica(inputs):
            model(inputs, training=True)
            rows = tf.cast(tf.shape(tf.nest.flatten(inputs)[0])[0], tf.float64)
            read = lambda v: tf.reshape(tf.cast(v.value, tf.float64), (-1,))
            moved = lambda variance: tf.cast(variance >= 0.0, tf.float64)
            return _pass_sums(layers, rows, read, moved)

        @tf.function
        def step(inputs):
            return strategy.reduce("SUM", strategy.run(replica, args=(inputs,)), axis=None)

        return lambda inputs: [np.stack([v.numpy() for v in s]) for s in step(inputs)]

    @staticmethod
    def total(sums, seen, used):
        return sums, seen, used


def _split(strategy, batch):
    """A batch of this process split evenly over the strategy's replicas in this process."""
    inputs = batch[0] if isinstance(batch, tuple) else batch
    local = len(strategy.extended.worker_devices)

    def part(context):
        # Replicas are numbered worker by worker: this worker's are consecutive.
        index = context.replica_id_in_sync_group % local
        return keras.tree.map_structure(
            lambda a: np.array_split(np.asarray(a), local)[index], inputs
        )

    return strategy.experimental_distribute_values_from_function(part)


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


def _flat_float64(variable):
    return np.asarray(keras.ops.convert_to_numpy(variable), np.float64).reshape(-1)


def _moved(variance):
    return (variance >= 0.0).astype(np.float64)
