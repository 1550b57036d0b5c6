"""`keras_bn.BatchNormMonitor`: BN's own health in TensorBoard."""

import threading

import keras
import numpy as np

from keras_bn import distribution
from keras_bn import population


class BatchNormMonitor(keras.callbacks.Callback):
    """A Keras callback logging every keras_bn layer's health to TensorBoard.

    The most common production failure of batch normalisation is silent: the
    moving statistics used at inference drift away from what training sees
    (stale statistics, a changed input pipeline, a layer left in the wrong
    mode), and results just get worse. Every `every_n_steps` optimizer steps
    (at the first batch end at or past each multiple, so also with
    `steps_per_execution` > 1; Keras' per-batch hook dispatch is then paid
    once per execution instead of once per step) the monitor runs the model in inference mode on a fixed `probe_data`
    batch, takes each keras_bn layer's input there, and logs:

    - `<layer>/train_inference_gap`: RMS(y_train − y_infer) / std(y_train),
      where y_train normalises the layer's input with its own batch
      statistics (training mode) and y_infer with the moving statistics
      (inference mode), both with the layer's γ, β and ε; 0 when the moving
      statistics match the probe batch, about 1 when they are unrelated.
    - `<layer>/mean_drift`: RMS over features of (μ_B − moving_mean) / σ_B.
    - `<layer>/variance_drift`: RMS over features of
      ln((moving_variance + ε) / (σ²_B + ε)).
    - histograms `<layer>/moving_mean`, `<layer>/moving_variance`,
      `<layer>/gamma`, `<layer>/beta`.

    Here μ_B, σ²_B are the probe batch's statistics of the layer's input
    (σ_B = √(σ²_B + ε)). Nothing in the model changes: the statistics are
    computed by the monitor, not by calling the layers in training mode.

    With `group_by` (a function from a layer name to a group name, for
    networks with many BN layers) it logs aggregates instead:
    `batch_norm/worst_train_inference_gap`, `batch_norm/median_train_inference_gap`,
    `<group>/worst_train_inference_gap`, and the histograms per group
    (`<group>/moving_mean`, ...), the group's layers concatenated.

    Under a `tf.distribute` strategy only the chief writes. Trainers with
    their own loop call `write_summaries(model, step)` inside their own
    writer instead of using the callback hooks.

    Args:
        log_dir: directory for the callback's TensorBoard event file (`None`
            to use only `write_summaries` with a caller's writer).
        probe_data: a batch of model inputs (array, tensor or structure),
            fixed for the run so the curves compare like with like.
        every_n_steps: int >= 1, default 100. Training batches between logs.
        group_by: `None` (per-layer summaries) or a function from a layer
            name to its group's name (aggregates).

    Raises:
        ValueError: for a bad `every_n_steps`, and at the first log for a
            model without keras_bn layers or whose layers' inputs cannot be
            reached from its inputs (not Sequential/functional).
    """

    # Keras may call the batch hook from its callback thread: training does not
    # wait for the hook (which only reads the model) on the 99 batches of 100
    # that log nothing.
    async_safe = True

    def __init__(self, log_dir, probe_data, every_n_steps=100, group_by=None):
        super().__init__()
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(
                f"Expected `every_n_steps` to be a positive int. Received: every_n_steps={every_n_steps!r}"
            )
        self.log_dir = log_dir
        self.probe_data = probe_data
        self.every_n_steps = every_n_steps
        self.group_by = group_by
        self._logged_step = 0
        self._lock = threading.Lock()
        self._writer = None
        self._probe_model = None
        self._probe_for = None

    def on_train_batch_end(self, batch, logs=None):
        # Steps are the optimizer's iterations, so a hook that Keras calls
        # once per `steps_per_execution` steps still logs on schedule; Keras'
        # callback threads may run hooks of consecutive batches at once, so
        # reading the step and logging are serialised.
        with self._lock:
            step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
            if step // self.every_n_steps > self._logged_step // self.every_n_steps:
                self._logged_step = step
                self._log(step)

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.flush()

    def _log(self, step):
        import tensorflow as tf  # TensorBoard summaries are written with tf.summary.

        if not distribution.is_chief():
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
        layers = population.batch_norm_layers(model)
        if not layers:
            raise ValueError(f"The model has no keras_bn.BatchNormalization layer. Received: model={model.name}")
        statistics = self._input_moments(model, layers)
        return [(layer, _layer_health(layer, *moments)) for layer, moments in zip(layers, statistics)]

    def write_summaries(self, model, step):
        """Writes the summaries of `model` at `step` with the default tf.summary writer.

        All of them go out as one batch of serialized summaries (building the
        histograms in NumPy), which keeps the monitor's cost per log to a few
        milliseconds.
        """
        import tensorflow as tf
        from tensorboard.plugins.histogram import summary_v2 as histogram_summary
        from tensorboard.plugins.scalar import summary_v2 as scalar_summary

        protos = []

        def scalar(tag, value, description):
            protos.append(scalar_summary.scalar_pb(tag, value, description=description))

        def histogram(tag, values):
            protos.append(histogram_summary.histogram_pb(tag, values))

        results = self.health(model)
        if self.group_by is None:
            for layer, metrics in results:
                for name, value in metrics.items():
                    scalar(f"{layer.name}/{name}", value, _DESCRIPTIONS[name])
                for name, values in _weights(layer).items():
                    histogram(f"{layer.name}/{name}", values)
        else:
            gaps = np.array([metrics["train_inference_gap"] for _, metrics in results])
            scalar("batch_norm/worst_train_inference_gap", gaps.max(),
                   "Largest train/inference gap over all BN layers. " + _DESCRIPTIONS["train_inference_gap"])
            scalar("batch_norm/median_train_inference_gap", float(np.median(gaps)),
                   "Median train/inference gap over all BN layers.")
            groups = {}
            for layer, metrics in results:
                groups.setdefault(self.group_by(layer.name), []).append((layer, metrics))
            for group, members in groups.items():
                scalar(f"{group}/worst_train_inference_gap", max(m["train_inference_gap"] for _, m in members),
                       f"Largest train/inference gap of the BN layers of {group}.")
                stacked = {}
                for layer, _ in members:
                    for name, values in _weights(layer).items():
                        stacked.setdefault(name, []).append(values.ravel())
                for name, values in stacked.items():
                    histogram(f"{group}/{name}", np.concatenate(values))
        tf.summary.experimental.write_raw_pb([p.SerializeToString() for p in protos], step=step)

    def _input_moments(self, model, layers):
        """Per-feature (mean, variance) of each layer's input on the probe batch.

        The probe forward pass (inference mode) and the moments run in one
        compiled function, called outside any replica context: under a
        tf.distribute strategy it reads the local copies and needs no
        collective (unlike Keras' distributed predict). Only C values per
        layer come back to NumPy.
        """
        if self._probe_for is not model:
            import tensorflow as tf

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
                [i for i in range(len(layer.input.shape)) if i not in layer.feature_axes]
                for layer in layers
            ]

            @tf.function
            def moments(data):
                outputs = probe(data, training=False)
                outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
                return [tf.nn.moments(tf.cast(x, tf.float64), a) for x, a in zip(outputs, axes)]

            self._probe_model, self._probe_for = moments, model
        return [
            (np.asarray(mean).ravel(), np.asarray(variance).ravel())
            for mean, variance in self._probe_model(self.probe_data)
        ]


_DESCRIPTIONS = {
    "train_inference_gap": (
        "RMS of (training-mode output − inference-mode output) over the fixed probe batch, in units "
        "of the training-mode output's standard deviation: 0 when the moving statistics match the "
        "batch, about 1 when they are unrelated."
    ),
    "mean_drift": "RMS over features of (batch mean − moving mean) / batch std on the probe batch.",
    "variance_drift": "RMS over features of ln((moving variance + ε) / (batch variance + ε)) on the probe batch.",
}


def _weights(layer):
    out = {
        "moving_mean": layer.moving_mean,
        "moving_variance": layer.moving_variance,
        "gamma": layer.gamma,
        "beta": layer.beta,
    }
    return {k: np.asarray(keras.ops.convert_to_numpy(v)) for k, v in out.items() if v is not None}


def _layer_health(layer, mean, variance):
    """Gap and drifts from the per-feature moments of the layer's input.

    Per feature both outputs are affine in x: y_train − y_infer = a·x + c with
    a = γ (1/σ_B − 1/σ_M) and c = γ (μ_M/σ_M − μ_B/σ_B), so the mean square
    difference is a²(σ²_B + μ²_B) + 2acμ_B + c²; y_train = γ x̂ + β has mean
    β and mean square γ²σ²_B/(σ²_B + ε) + β² per feature (σ_B = √(σ²_B + ε),
    σ_M = √(moving_variance + ε), μ_M = moving_mean; every feature counts the
    same number of values).
    """
    weights = {k: v.astype(np.float64).ravel() for k, v in _weights(layer).items()}
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
        "variance_drift": float(np.sqrt(np.mean(np.log((moving_variance + eps) / (variance + eps)) ** 2))),
    }
