"""`keras_bn.BatchNormMonitor`: BN's own health in TensorBoard."""

import functools
import threading

import keras
import numpy as np

from keras_bn import distribution
from keras_bn import population
from keras_bn import validation


class BatchNormMonitor(keras.callbacks.Callback):
    """A Keras callback logging every keras_bn layer's health to TensorBoard.

    The most common production failure of batch normalisation is silent: the
    moving statistics used at inference drift away from what training sees
    (stale statistics, a changed input pipeline, a layer left in the wrong
    mode), and results just get worse. Every `every_n_steps` optimizer steps,
    and once more at the end of training if the last step was not logged
    (at the first batch end at or past each multiple, so also with
    `steps_per_execution` > 1; Keras' per-batch hook dispatch is then paid
    once per execution instead of once per step) the monitor runs the model in
    inference mode on a fixed `probe_data`
    batch, takes each keras_bn layer's input there, and logs:

    - `<layer>/train_inference_gap`: RMS(y_train − y_infer) / std(y_train),
      where y_train normalises the layer's input with its own batch
      statistics (training mode) and y_infer with the moving statistics
      (inference mode), both with the layer's γ, β and ε; 0 when the moving
      statistics match the probe batch, about 1 when they are unrelated.
    - `<layer>/mean_drift`: RMS over features of (μ_B − moving_mean) / σ_B.
    - `<layer>/variance_drift`: RMS over features of
      ln((moving_variance + ε) / (σ²_B + ε)).
    - `<layer>/skipped_updates`: the updates the layer skipped for a
      non-finite batch (`skip_nonfinite_updates=True`) or a batch of one
      value per feature.
    - histograms `<layer>/moving_mean`, `<layer>/moving_variance`,
      `<layer>/gamma`, `<layer>/beta`.

    Here μ_B, σ²_B are the probe batch's statistics of the layer's input
    (σ_B = √(σ²_B + ε)). Nothing in the model changes: the statistics are
    computed by the monitor, not by calling the layers in training mode.

    With `group_by` (a function from a layer name to a group name, for
    networks with many BN layers) it logs aggregates instead:
    `batch_norm/worst_train_inference_gap`, `batch_norm/median_train_inference_gap`,
    `batch_norm/skipped_updates` (the sum over layers),
    `<group>/worst_train_inference_gap`, and the histograms per group
    (`<group>/moving_mean`, ...), the group's layers concatenated.

    On JAX and PyTorch the probe is one inference call with the moments in
    NumPy; under a multi-process JAX `keras.distribution` job only process 0
    probes and writes. Under a `tf.distribute` strategy only the chief probes
    and writes; it
    probes in its first local replica with that replica's copies of the
    moving statistics (the same on every replica with `synchronized=True`),
    so no collective is issued and the other workers of a
    `MultiWorkerMirroredStrategy` run never wait for it. Trainers with their
    own loop call `write_summaries(model, step)` inside their own writer
    (every worker may call it) instead of using the callback hooks.

    The monitor needs TensorFlow (for `tf.summary`) on every Keras backend:
    install it with `pip install "keras-bn[tensorflow]"`.

    Args:
        log_dir: directory for the callback's TensorBoard event file (`None`
            to use only `write_summaries` with a caller's writer).
        probe_data: a batch of model inputs (array, tensor or structure),
            fixed for the run so the curves compare like with like.
        every_n_steps: int >= 1, default 100. Training batches between logs.
        group_by: `None` (per-layer summaries) or a function from a layer
            name to its group's name (aggregates).

    Raises:
        ImportError: when TensorFlow is not installed.
        ValueError: for a bad `every_n_steps`, and at the first log for a
            model without keras_bn layers or whose layers' inputs cannot be
            reached from its inputs (not Sequential/functional).
    """

    @property
    def async_safe(self):
        # On TensorFlow Keras may call the batch hook from its callback thread:
        # training does not wait for the hook (which only reads the model, with
        # no collective) on the 99 batches of 100 that log nothing. JAX's fit
        # donates the variables' buffers to each step, so a probe running
        # beside training could read a deleted buffer: there hooks run in line.
        return keras.backend.backend() == "tensorflow"

    def __init__(self, log_dir, probe_data, every_n_steps=100, group_by=None):
        super().__init__()
        _require_tensorflow()
        self.log_dir = log_dir
        self.probe_data = probe_data
        self.every_n_steps = validation.positive_int("every_n_steps", every_n_steps)
        self.group_by = group_by
        self._lock = threading.Lock()
        self._writer = None
        self._probe = None
        self._probe_for = None
        self._first_step = self._epoch_start = self._step = self._logged_step = 0

    def on_train_begin(self, logs=None):
        # The optimizer's step count is read once per `fit` (it continues a
        # resumed run); batches are then counted in Python, so the per-batch
        # hook reads nothing from the device.
        self._first_step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        self._epoch_start = self._step = self._logged_step = self._first_step

    def on_train_batch_end(self, batch, logs=None):
        # `batch` is the epoch's last finished step (the last of an execution
        # with `steps_per_execution` > 1; Keras counts a short last execution
        # as a full one, hence the clamp to the epoch's steps). Keras'
        # callback threads may run the hooks of consecutive batches at once,
        # so counting and logging are serialised.
        with self._lock:
            steps = (self.params or {}).get("steps")
            done = batch + 1 if not steps else min(batch + 1, steps)
            self._step = max(self._step, self._epoch_start + done)
            if self._step // self.every_n_steps > self._logged_step // self.every_n_steps:
                self._logged_step = self._step
                self._log(self._step)

    def on_epoch_end(self, epoch, logs=None):
        # Keras has finished the epoch's batch hooks before calling this; the
        # optimizer's count (read once per epoch) also corrects the Python
        # count where an epoch's length was unknown.
        with self._lock:
            self._epoch_start = self._step = int(
                keras.ops.convert_to_numpy(self.model.optimizer.iterations)
            )

    def on_train_end(self, logs=None):
        # The final state is always logged, so every `fit` leaves a point
        # (also one shorter than `every_n_steps`).
        with self._lock:
            if self._step > self._logged_step:
                self._logged_step = self._step
                self._log(self._step)
        if self._writer is not None:
            self._writer.flush()

    def _log(self, step):
        import tensorflow as tf  # TensorBoard summaries are written with tf.summary.

        if not distribution.is_chief(_strategy(self.model)):
            return
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        with self._writer.as_default(step=step):
            self.write_summaries(self.model, step)

    def health(self, model):
        """Each keras_bn layer's gap and drifts on the probe batch.

        Returns:
            A list of `(layer, {"train_inference_gap", "mean_drift",
            "variance_drift"})`, in the model's layer order.
        """
        return [(layer, _layer_health(layer, *state)) for layer, state in self._probe_state(model)]

    def write_summaries(self, model, step):
        """Writes the summaries of `model` at `step` with the default tf.summary writer.

        All of them go out as one batch of serialized summaries (building the
        histograms in NumPy), which keeps the monitor's cost per log to a few
        milliseconds. Off the chief of a multi-worker run it does nothing, so
        every worker of a custom loop may call it.
        """
        from tensorboard.plugins.histogram import summary_v2 as histogram_summary
        from tensorboard.plugins.scalar import summary_v2 as scalar_summary
        import tensorflow as tf

        if not distribution.is_chief(_strategy(model)):
            return
        states = self._probe_state(model)
        results = [(layer, _layer_health(layer, *state)) for layer, state in states]
        weights = {layer: dict(state[2]) for layer, state in states}
        skipped = {layer: w.pop("skipped_updates", None) for layer, w in weights.items()}
        if self.group_by is None:
            scalars, histograms = _per_layer_summaries(results, weights, skipped)
        else:
            scalars, histograms = _grouped_summaries(results, weights, skipped, self.group_by)
        protos = [
            scalar_summary.scalar_pb(tag, value, description=description)
            for tag, value, description in scalars
        ] + [histogram_summary.histogram_pb(tag, values) for tag, values in histograms]
        tf.summary.experimental.write_raw_pb([p.SerializeToString() for p in protos], step=step)

    def _probe_state(self, model):
        """Per keras_bn layer: `(layer, (mean, variance, weights))` on the probe batch.

        `mean`, `variance` are the per-feature moments of the layer's input on
        the probe batch; `weights` its moving statistics, γ and β. The probe
        forward pass (inference mode), the moments and the weight reads run
        in one compiled call; only C values per tensor come back to NumPy.
        Under a `tf.distribute` strategy with several replicas the call runs
        in the first local replica (`strategy.run`), which reads that
        replica's own copies: no collective, so one process may probe while
        the others train (identical copies with `synchronized=True`).
        """
        layers = population.batch_norm_layers(model)
        if not layers:
            raise ValueError(
                f"The model has no keras_bn.BatchNormalization layer. Received: model={model.name}"
            )
        if self._probe_for is not model:
            self._probe = _compile_probe(model, layers)
            self._probe_for = model
        moments, weights = self._probe(self.probe_data)
        return [
            (
                layer,
                (
                    np.asarray(mean).ravel(),
                    np.asarray(variance).ravel(),
                    {k: np.asarray(v) for k, v in w.items()},
                ),
            )
            for layer, (mean, variance), w in zip(layers, moments, weights)
        ]


def _per_layer_summaries(results, weights, skipped):
    """`(scalars, histograms)` of each layer: (tag, value, description), (tag, values)."""
    scalars, histograms = [], []
    for layer, metrics in results:
        for name, value in metrics.items():
            scalars.append((f"{layer.name}/{name}", value, _DESCRIPTIONS[name]))
        if skipped[layer] is not None:
            scalars.append(
                (
                    f"{layer.name}/skipped_updates",
                    float(skipped[layer]),
                    _DESCRIPTIONS["skipped_updates"],
                )
            )
        histograms += [(f"{layer.name}/{name}", values) for name, values in weights[layer].items()]
    return scalars, histograms


def _grouped_summaries(results, weights, skipped, group_by):
    """`(scalars, histograms)` aggregated over all layers and over each `group_by` group."""
    gaps = np.array([metrics["train_inference_gap"] for _, metrics in results])
    scalars = [
        (
            "batch_norm/worst_train_inference_gap",
            gaps.max(),
            "Largest train/inference gap over all BN layers. "
            + _DESCRIPTIONS["train_inference_gap"],
        ),
        (
            "batch_norm/median_train_inference_gap",
            float(np.median(gaps)),
            "Median train/inference gap over all BN layers.",
        ),
    ]
    counts = [float(c) for c in skipped.values() if c is not None]
    if counts:
        scalars.append(
            (
                "batch_norm/skipped_updates",
                sum(counts),
                "Sum over BN layers. " + _DESCRIPTIONS["skipped_updates"],
            )
        )
    groups, histograms = {}, []
    for layer, metrics in results:
        groups.setdefault(group_by(layer.name), []).append((layer, metrics))
    for group, members in groups.items():
        scalars.append(
            (
                f"{group}/worst_train_inference_gap",
                max(m["train_inference_gap"] for _, m in members),
                f"Largest train/inference gap of the BN layers of {group}.",
            )
        )
        stacked = {}
        for layer, _ in members:
            for name, values in weights[layer].items():
                stacked.setdefault(name, []).append(values.ravel())
        histograms += [(f"{group}/{name}", np.concatenate(v)) for name, v in stacked.items()]
    return scalars, histograms


def _require_tensorflow():
    """The monitor writes with `tf.summary`; without TensorFlow it says what to install."""
    try:
        import tensorflow  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "keras_bn.BatchNormMonitor writes TensorBoard summaries with TensorFlow's "
            'tf.summary, and TensorFlow is not installed: pip install "keras-bn[tensorflow]"'
        ) from error


def _strategy(model):
    """The model's `tf.distribute` strategy (TensorFlow backend), else `None`."""
    return getattr(model, "distribute_strategy", None)


def _compile_probe(model, layers):
    """The probe: `data -> (moments per layer, weights per layer)`, compiled on TensorFlow."""
    try:
        inputs = model.inputs[0] if len(model.inputs) == 1 else model.inputs
        probe = keras.Model(inputs, [layer.input for layer in layers])
    except (AttributeError, ValueError) as error:
        raise ValueError(
            "BatchNormMonitor reads each keras_bn layer's input through the model's "
            "graph, which needs a Sequential or functional model whose keras_bn layers "
            f"are called once. Received: model={type(model).__name__} ({error})"
        ) from error
    axes = [
        tuple(i for i in range(len(layer.input.shape)) if i not in layer.feature_axes)
        for layer in layers
    ]
    if keras.backend.backend() != "tensorflow":
        return functools.partial(_eager_probe_pass, probe, layers, axes)
    return _tf_probe(model, probe, layers, axes)


def _eager_probe_pass(probe, layers, axes, data):
    """The probe on JAX and PyTorch: one inference call, moments in NumPy float64."""
    outputs = probe(data, training=False)
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    moments = []
    for x, a in zip(outputs, axes):
        x = np.asarray(keras.ops.convert_to_numpy(x), np.float64)
        moments.append((x.mean(axis=a), x.var(axis=a)))
    weights = [
        {name: keras.ops.convert_to_numpy(v) for name, v in _weight_variables(layer).items()}
        for layer in layers
    ]
    return moments, weights


def _tf_probe(model, probe, layers, axes):
    """The probe as one `tf.function`, in the first local replica under a strategy."""
    import tensorflow as tf

    def probe_pass(data):
        outputs = probe(data, training=False)
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        moments = [tf.nn.moments(tf.cast(x, tf.float64), a) for x, a in zip(outputs, axes)]
        weights = [
            {
                name: tf.identity(keras.ops.convert_to_tensor(v))
                for name, v in _weight_variables(layer).items()
            }
            for layer in layers
        ]
        return moments, weights

    strategy = _strategy(model)
    if strategy is None or strategy.num_replicas_in_sync == 1:
        return tf.function(probe_pass)

    @tf.function
    def first_replica_probe_pass(data):
        results = strategy.run(probe_pass, args=(data,))
        return tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], results)

    return first_replica_probe_pass


_DESCRIPTIONS = {
    "train_inference_gap": (
        "RMS of (training-mode output − inference-mode output) over the fixed probe batch, "
        "in units "
        "of the training-mode output's standard deviation: 0 when the moving statistics match the "
        "batch, about 1 when they are unrelated."
    ),
    "skipped_updates": (
        "Training batches the layer kept out of its moving statistics: non-finite ones, and "
        "those of one value per feature."
    ),
    "mean_drift": "RMS over features of (batch mean − moving mean) / batch std on the probe batch.",
    "variance_drift": (
        "RMS over features of ln((moving variance + ε) / (batch variance + ε)) on the probe batch."
    ),
}


def _weight_variables(layer):
    out = {
        "moving_mean": layer.moving_mean,
        "moving_variance": layer.moving_variance,
        "gamma": layer.gamma,
        "beta": layer.beta,
        "skipped_updates": layer.skipped_updates,
    }
    return {k: v for k, v in out.items() if v is not None}


def _layer_health(layer, mean, variance, weights):
    """Gap and drifts from the per-feature moments of the layer's input.

    Per feature both outputs are affine in x: y_train − y_infer = a·x + c with
    a = γ (1/σ_B − 1/σ_M) and c = γ (μ_M/σ_M − μ_B/σ_B), so the mean square
    difference is a²(σ²_B + μ²_B) + 2acμ_B + c²; y_train = γ x̂ + β has mean
    β and mean square γ²σ²_B/(σ²_B + ε) + β² per feature (σ_B = √(σ²_B + ε),
    σ_M = √(moving_variance + ε), μ_M = moving_mean; every feature counts the
    same number of values).
    """
    weights = {k: v.astype(np.float64).ravel() for k, v in weights.items()}
    gamma, beta = weights.get("gamma", 1.0), weights.get("beta", np.zeros_like(mean))
    moving_mean, moving_variance = weights["moving_mean"], weights["moving_variance"]
    eps = layer.epsilon
    batch_std, moving_std = np.sqrt(variance + eps), np.sqrt(moving_variance + eps)
    a = gamma * (1.0 / batch_std - 1.0 / moving_std)
    c = gamma * (moving_mean / moving_std - mean / batch_std)
    squared_difference = np.mean(a * a * (variance + mean * mean) + 2 * a * c * mean + c * c)
    spread = np.mean(gamma * gamma * variance / (variance + eps) + beta * beta) - np.mean(beta) ** 2
    gap = np.sqrt(max(squared_difference, 0.0) / spread) if spread > 0 else 0.0
    return {
        "train_inference_gap": float(gap),
        "mean_drift": float(np.sqrt(np.mean(((mean - moving_mean) / batch_std) ** 2))),
        "variance_drift": float(
            np.sqrt(np.mean(np.log((moving_variance + eps) / (variance + eps)) ** 2))
        ),
    }
