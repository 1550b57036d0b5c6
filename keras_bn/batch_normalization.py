"""`keras_bn.BatchNormalization`: the layer of Ioffe & Szegedy (2015)."""

import numbers

import keras
from keras import constraints
from keras import initializers
from keras import ops
from keras import regularizers

from keras_bn import moments
from keras_bn import normalize


@keras.saving.register_keras_serializable(package="keras_bn")
class BatchNormalization(keras.layers.Layer):
    """Batch normalization (Ioffe & Szegedy, 2015).

    In training (`training=True` and the layer trainable) each feature is
    normalised with the statistics of the current mini-batch, computed over
    every axis not in `axis` (so a conv map `(N, H, W, C)` with `axis=-1` is
    normalised per channel over m = N·H·W values):

        μ_B = (1/m) Σ x_i,       σ²_B = (1/m) Σ (x_i − μ_B)²   (biased),
        x̂_i = (x_i − μ_B) / √(σ²_B + ε),    y_i = γ x̂_i + β.

    Gradients flow through μ_B and σ²_B (the paper's backward formulas, in
    their compact form). In inference (`training=False` or unset) the layer
    uses its moving statistics, so each example's output is deterministic and
    independent of its batch companions:

        y = γ (x − moving_mean) / √(moving_variance + ε) + β.

    Moving statistics. With a float `momentum`, after every training step

        moving_mean     = moving_mean * momentum     + μ_B * (1 − momentum)
        moving_variance = moving_variance * momentum + v_B * (1 − momentum)

    (Keras' convention: momentum is the weight of the *old* value). With
    `momentum=None` they are the exact running averages over all training
    batches seen, E[x] = E_B[μ_B] and Var[x] = E_B[v_B] (paper Algorithm 2,
    steps 8–11), each batch weighted equally. Here v_B = σ²_B by default
    (matching Keras), or v_B = m/(m−1)·σ²_B, the paper's unbiased population
    estimate, with `unbiased_variance=True`; m counts the values a statistic
    is over (m·p·q for conv maps; the global m under synchronisation).
    Batches with no values (an empty replica) leave the statistics unchanged.

    Synchronisation. With `synchronized=True`, in a replica context of
    `MirroredStrategy`, `MultiWorkerMirroredStrategy` or `TPUStrategy`, the
    statistics are those of the global batch: every replica's
    (count, mean, Σ(x−mean)²) is merged with the stable parallel formula, and
    the input gradient all-reduces Σg and Σg·x̂ (2C floats) once. The forward
    merge all-reduces 3C + 1 floats in two collectives whatever the replica
    count R (one collective of R·(2C + 1) floats when R = 2). Without a
    strategy, in cross-replica context or with one replica the flag has no
    effect (local moments are then global).

    Replica groups. With `sync_group_size=k`, replicas are grouped
    consecutively by replica id (0…k−1, k…2k−1, …) and each group normalises
    with its own group's batch, forward and backward; replicas with unequal
    or empty batches are count-weighted within their group. The forward pass
    all-reduces G·(2C + 1) floats (G = R/k groups), the backward G·2C. Each
    replica updates its moving statistics with its group's moments, so the
    replicas' copies differ between groups; a checkpoint, export or any
    cross-replica read holds their average over replicas, i.e. the mean of
    the groups' moving statistics (for the variance: the mean within-group
    variance), and a restore gives every replica that average. `k=1` means
    local statistics.

    Precision. Statistics, weights and arithmetic are float32 whatever the
    input dtype; the output is cast to the layer's `compute_dtype`. Under a
    `mixed_float16` policy inputs up to the float16 maximum (6.5e4) do not
    overflow.

    Frozen layers. As in Keras, a layer with `trainable=False` always runs in
    inference mode and never updates its moving statistics.

    Args:
        axis: int or list/tuple of ints, default -1. The feature axes, which
            keep their own statistics; e.g. `axis=1` for channels-first maps.
        momentum: float in [0, 1) or `None`, default 0.99. The moving-average
            momentum above; `None` selects the exact cumulative average.
        epsilon: float >= 0, default 1e-3. Added to the variance before the
            square root (the paper's ε), including at inference.
        center: bool, default True. Adds the offset β.
        scale: bool, default True. Multiplies by γ; disable it when the next
            layer is linear (e.g. `relu`), which can absorb the scale.
        unbiased_variance: bool, default False. Accumulate m/(m−1)·σ²_B in
            the moving variance (paper) instead of σ²_B (Keras).
        synchronized: bool, default False. Normalise with global-batch
            moments across replicas (see above).
        sync_group_size: int >= 1 or `None`, default None (all replicas).
            With `synchronized=True`, the replicas per group (see above); it
            must divide the number of replicas in sync.
        beta_initializer: default "zeros".
        gamma_initializer: default "ones".
        moving_mean_initializer: default "zeros".
        moving_variance_initializer: default "ones".
        beta_regularizer: default None.
        gamma_regularizer: default None.
        beta_constraint: default None.
        gamma_constraint: default None.
        **kwargs: base `Layer` arguments (`name`, `dtype`, `trainable`, ...).

    Call arguments:
        inputs: floating-point tensor of any rank >= 1 (1 only when `axis`
            covers it).
        training: bool. True normalises with batch statistics and updates
            the moving statistics; False/None uses the moving statistics.
        mask: optional boolean tensor of `inputs`' shape minus its last axis
            (Keras' convention). Masked-out positions do not count towards
            the batch statistics. Requires `axis` to be the last axis alone.

    Returns:
        A tensor of the inputs' shape in the layer's `compute_dtype`.

    Raises:
        ValueError: for an invalid `axis`, `momentum` or `epsilon`, an axis
            out of range or an undefined feature dimension at build, a
            training batch whose statistics would be over a single value
            (m = 1) when that is known statically, an unsupported mask,
            `sync_group_size` < 1 or without `synchronized=True`, and at the
            first synchronised call a `sync_group_size` that does not divide
            the replica count.
        TypeError: for non-float inputs, non-bool flags or a non-int
            `sync_group_size`.
        RuntimeError: when a synchronised call runs where its collective
            cannot (inside a `tf.function` nested in `strategy.run`).

    Reference:
        S. Ioffe and C. Szegedy, "Batch Normalization: Accelerating Deep
        Network Training by Reducing Internal Covariate Shift", ICML 2015,
        arXiv:1502.03167.
    """

    def __init__(
        self,
        axis=-1,
        momentum=0.99,
        epsilon=1e-3,
        center=True,
        scale=True,
        unbiased_variance=False,
        synchronized=False,
        sync_group_size=None,
        beta_initializer="zeros",
        gamma_initializer="ones",
        moving_mean_initializer="zeros",
        moving_variance_initializer="ones",
        beta_regularizer=None,
        gamma_regularizer=None,
        beta_constraint=None,
        gamma_constraint=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.axis = _coerce_axis(axis)
        self.momentum = _coerce_momentum(momentum)
        self.epsilon = _coerce_epsilon(epsilon)
        self.center = _coerce_bool("center", center)
        self.scale = _coerce_bool("scale", scale)
        self.unbiased_variance = _coerce_bool(
            "unbiased_variance", unbiased_variance
        )
        self.synchronized = _coerce_bool("synchronized", synchronized)
        self.sync_group_size = _coerce_group_size(
            sync_group_size, self.synchronized
        )
        self.beta_initializer = initializers.get(beta_initializer)
        self.gamma_initializer = initializers.get(gamma_initializer)
        self.moving_mean_initializer = initializers.get(moving_mean_initializer)
        self.moving_variance_initializer = initializers.get(
            moving_variance_initializer
        )
        self.beta_regularizer = regularizers.get(beta_regularizer)
        self.gamma_regularizer = regularizers.get(gamma_regularizer)
        self.beta_constraint = constraints.get(beta_constraint)
        self.gamma_constraint = constraints.get(gamma_constraint)
        self.supports_masking = True
        self.gamma = None
        self.beta = None
        self.moving_mean = None
        self.moving_variance = None
        self.moving_batches = None
        # Set by `estimate_population_statistics`: called eagerly with every
        # training batch's (count, mean, variance).
        self._statistics_observer = None

    def build(self, input_shape):
        rank = len(input_shape)
        axes = []
        for axis in self.axis:
            if not -rank <= axis < rank:
                raise ValueError(
                    f"Axis {axis} is out of range for inputs of rank {rank} "
                    f"(shape {tuple(input_shape)}). Received: axis={self.axis}"
                )
            axes.append(axis % rank)
        if len(set(axes)) != len(axes):
            raise ValueError(
                "Axes must be distinct after resolving negative values for "
                f"rank {rank}. Received: axis={self.axis}"
            )
        self._feature_axes = tuple(sorted(axes))
        for axis in self._feature_axes:
            if input_shape[axis] is None:
                raise ValueError(
                    f"The feature axis {axis} must have a defined dimension. "
                    f"Received: input_shape={tuple(input_shape)}"
                )
        self._reduction_axes = tuple(
            i for i in range(rank) if i not in self._feature_axes
        )
        shape = tuple(input_shape[a] for a in self._feature_axes)
        self._broadcast_shape = tuple(
            input_shape[i] if i in self._feature_axes else 1
            for i in range(rank)
        )
        if self.scale:
            self.gamma = self.add_weight(
                shape=shape,
                name="gamma",
                initializer=self.gamma_initializer,
                regularizer=self.gamma_regularizer,
                constraint=self.gamma_constraint,
                trainable=True,
                autocast=False,
            )
        if self.center:
            self.beta = self.add_weight(
                shape=shape,
                name="beta",
                initializer=self.beta_initializer,
                regularizer=self.beta_regularizer,
                constraint=self.beta_constraint,
                trainable=True,
                autocast=False,
            )
        # Moving statistics are sync-on-read: each replica updates its own
        # copy with no communication (under synchronisation the copies are
        # identical), and a cross-replica read (checkpoint, export) averages.
        self.moving_mean = self._statistic(
            "moving_mean", shape, self.moving_mean_initializer
        )
        self.moving_variance = self._statistic(
            "moving_variance", shape, self.moving_variance_initializer
        )
        if self.momentum is None:
            self.moving_batches = self._statistic(
                "moving_batches", (), initializers.Zeros()
            )
        self.input_spec = keras.layers.InputSpec(
            ndim=rank, axes={a: input_shape[a] for a in self._feature_axes}
        )

    def _statistic(self, name, shape, initializer):
        with keras.name_scope(self.name, caller=self):
            return keras.Variable(
                initializer=initializer,
                shape=shape,
                dtype="float32",
                trainable=False,
                autocast=False,
                synchronization="on_read",
                aggregation="mean",
                name=name,
            )

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, inputs, training=None, mask=None):
        if not keras.backend.is_float_dtype(inputs.dtype):
            raise TypeError(
                f"{type(self).__name__} needs floating-point inputs. "
                f"Received: inputs.dtype={keras.backend.standardize_dtype(inputs.dtype)}"
            )
        x = ops.cast(inputs, "float32")
        gamma = self._broadcast(self.gamma, 1.0)
        beta = self._broadcast(self.beta, 0.0)
        if training and self.trainable:
            weights = self._mask_weights(inputs, mask)
            if weights is None:
                self._check_static_count(inputs.shape)
            groups = (
                moments.replica_groups(
                    moments.sync_replica_context(), self.sync_group_size
                )
                if self.synchronized
                else None
            )
            y, mean, variance, count = (
                normalize.normalize_with_batch_statistics(
                    x,
                    gamma,
                    beta,
                    axes=self._reduction_axes,
                    epsilon=self.epsilon,
                    weights=weights,
                    groups=groups,
                )
            )
            mean = ops.reshape(mean, self.moving_mean.shape)
            variance = ops.reshape(variance, self.moving_variance.shape)
            if self._statistics_observer is not None:
                self._statistics_observer(count, mean, variance)
            self._update_moving_statistics(mean, variance, count)
        else:
            y = normalize.normalize_with_statistics(
                x,
                self._broadcast(self.moving_mean, 0.0),
                self._broadcast(self.moving_variance, 1.0),
                gamma,
                beta,
                self.epsilon,
            )
        return ops.cast(y, self.compute_dtype)

    def _broadcast(self, variable, default):
        if variable is None:
            return ops.full(self._broadcast_shape, default, dtype="float32")
        return ops.reshape(ops.cast(variable, "float32"), self._broadcast_shape)

    def _mask_weights(self, inputs, mask):
        if mask is None:
            return None
        rank = len(inputs.shape)
        if len(mask.shape) != rank - 1:
            raise ValueError(
                "The mask must have one dimension less than the inputs. "
                f"Received: mask.shape={tuple(mask.shape)}, "
                f"inputs.shape={tuple(inputs.shape)}"
            )
        if self._feature_axes != (rank - 1,):
            raise ValueError(
                "Masking needs the features on the last axis alone. "
                f"Received: axis={self.axis}"
            )
        return ops.expand_dims(ops.cast(mask, "float32"), -1)

    def _check_static_count(self, shape):
        count = 1
        for axis in self._reduction_axes:
            if shape[axis] is None:
                return
            count *= shape[axis]
        if count == 1:
            raise ValueError(
                "Training-mode batch statistics would be over a single value "
                "per feature (m=1), which makes every output β. Use a larger "
                "batch or training=False. "
                f"Received: inputs.shape={tuple(shape)}"
            )

    def _update_moving_statistics(self, mean, variance, count):
        if self.unbiased_variance:
            # m/(m−1) for m > 1; a single value carries no spread to correct.
            variance = variance * ops.where(
                count > 1.0, count / ops.maximum(count - 1.0, 1.0), 1.0
            )
        has_values = ops.cast(count > 0.0, "float32")
        if self.momentum is None:
            batches = self.moving_batches + has_values
            rate = ops.divide_no_nan(has_values, batches)
            self.moving_batches.assign(batches)
        else:
            rate = (1.0 - self.momentum) * has_values
        keep = 1.0 - rate
        self.moving_mean.assign(self.moving_mean * keep + mean * rate)
        self.moving_variance.assign(
            self.moving_variance * keep + variance * rate
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "axis": list(self.axis) if len(self.axis) > 1 else self.axis[0],
                "momentum": self.momentum,
                "epsilon": self.epsilon,
                "center": self.center,
                "scale": self.scale,
                "unbiased_variance": self.unbiased_variance,
                "synchronized": self.synchronized,
                "sync_group_size": self.sync_group_size,
                "beta_initializer": initializers.serialize(
                    self.beta_initializer
                ),
                "gamma_initializer": initializers.serialize(
                    self.gamma_initializer
                ),
                "moving_mean_initializer": initializers.serialize(
                    self.moving_mean_initializer
                ),
                "moving_variance_initializer": initializers.serialize(
                    self.moving_variance_initializer
                ),
                "beta_regularizer": regularizers.serialize(
                    self.beta_regularizer
                ),
                "gamma_regularizer": regularizers.serialize(
                    self.gamma_regularizer
                ),
                "beta_constraint": constraints.serialize(self.beta_constraint),
                "gamma_constraint": constraints.serialize(
                    self.gamma_constraint
                ),
            }
        )
        return config


def _coerce_axis(axis):
    values = list(axis) if isinstance(axis, (list, tuple)) else [axis]
    if not values or not all(
        isinstance(a, numbers.Integral) and not isinstance(a, bool)
        for a in values
    ):
        raise TypeError(
            "Expected `axis` to be an int or a non-empty list of ints. "
            f"Received: axis={axis!r}"
        )
    return tuple(int(a) for a in values)


def _coerce_momentum(momentum):
    if momentum is None:
        return None
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real):
        raise TypeError(
            f"Expected `momentum` to be a float or None. Received: momentum={momentum!r}"
        )
    momentum = float(momentum)
    if not 0.0 <= momentum < 1.0:
        raise ValueError(
            f"Expected `momentum` in [0, 1) or None. Received: momentum={momentum}"
        )
    return momentum


def _coerce_epsilon(epsilon):
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real):
        raise TypeError(
            f"Expected `epsilon` to be a float. Received: epsilon={epsilon!r}"
        )
    epsilon = float(epsilon)
    if not epsilon >= 0.0:  # also rejects NaN
        raise ValueError(
            f"Expected `epsilon` >= 0. Received: epsilon={epsilon}"
        )
    return epsilon


def _coerce_group_size(group_size, synchronized):
    if group_size is None:
        return None
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        raise TypeError(
            "Expected `sync_group_size` to be an int or None. "
            f"Received: sync_group_size={group_size!r}"
        )
    if group_size < 1:
        raise ValueError(
            "Expected `sync_group_size` >= 1. "
            f"Received: sync_group_size={group_size}"
        )
    if not synchronized:
        raise ValueError(
            "`sync_group_size` groups replicas for synchronised statistics and "
            "needs synchronized=True. "
            f"Received: sync_group_size={group_size}, synchronized=False"
        )
    return int(group_size)


def _coerce_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"Expected `{name}` to be a bool. Received: {name}={value!r}")
    return value
