"""`keras_bn.BatchNormalization`: the layer of Ioffe & Szegedy (2015)."""

import numbers

import keras
from keras import constraints
from keras import initializers
from keras import ops
from keras import regularizers

from keras_bn import moments
from keras_bn import normalize
from keras_bn import slices


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

    Ghost batches (Hoffer et al. 2017). With `virtual_batch_size=v`, in
    training each replica's batch is split into consecutive sub-batches of v
    examples, each normalised with its own moments (and its own gradient
    paths through them). The moving statistics move, once per step, towards
    the average of the ghost batches' means and of their variances (the
    pooled within-ghost-batch variance; with `unbiased_variance=True` the
    pooled unbiased Σ M2 / Σ (n − 1), n a ghost batch's count per feature),
    so that they estimate what a v-example batch sees. At inference v plays no part: any batch size
    works. v must divide each replica's batch (a `ValueError` naming both
    numbers; with a batch size known only at run time, TensorFlow's
    run-time assertion names them). Not combinable with
    `synchronized=True`.

    Engines. Which examples share statistics in training is the same under
    `tf.distribute` and under Keras 3's `keras.distribution` on JAX
    (`DataParallel`, `ModelParallel`), where the layer sees the global batch:
    a replica is one position on the mesh's batch axis
    (`device_mesh`, `batch_dim_name`), and the batch is reshaped to
    (replicas, per-replica) so each replica's statistics need no collective.
    Local: each replica's own batch. `synchronized=True`: the global batch,
    or consecutive groups of `sync_group_size` replicas, whose sums XLA
    all-reduces. There every replica shares one replicated copy of the
    moving statistics, which moves towards the average of the replicas' (or
    groups') moments, the value a `tf.distribute` checkpoint averages to. On
    JAX without a distribution (or with one replica on the batch axis)
    `synchronized=True` means the whole batch, as under `tf.distribute`
    without a strategy. Unequal per-replica batches cannot occur under SPMD.

    Batch Renormalization (Ioffe 2017). With `renorm=True`, training uses
    y = γ (r x̂ + d) + β with r = σ_B / σ_R and d = (μ_B − μ_R) / σ_R, where
    σ_B = √(σ²_B + ε) and μ_R, σ_R are moving averages of μ_B and σ_B with
    `renorm_momentum` (weights `renorm_mean`, `renorm_stddev`, σ_R at least
    √ε). r is clipped to [rmin, rmax] and d to [−dmax, dmax] from
    `renorm_clipping`; both are held out of the gradient. The inference
    statistics then track the standard deviation: `moving_stddev` averages
    √(v_B + ε) with `momentum`, and `moving_variance` = moving_stddev² − ε
    (clipped at 0). Inference is the same transform as without renorm. Under
    synchronisation r and d come from the group's (or global) moments.
    Argument names and semantics are Keras'.

    Precision. Statistics and arithmetic are in float32 for float16,
    bfloat16 and float32 inputs and in float64 for float64 inputs (a layer
    with `dtype="float64"`); the moving statistics, γ and β have that dtype
    too (for mixed policies, float32). The output is cast to the layer's
    `compute_dtype`. Under a `mixed_float16` policy inputs up to the float16
    maximum (6.5e4) do not overflow.

    Backends. With local statistics and ghost batches the layer runs on
    every Keras 3 backend (TensorFlow, JAX, PyTorch). `synchronized=True`
    needs TensorFlow's `tf.distribute` or JAX (`keras.distribution`); on
    PyTorch it raises a `ValueError` naming the backend.

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
        virtual_batch_size: int >= 2 or `None`, default None. Ghost batch
            size in training (see above); must divide each replica's batch.
        renorm: bool, default False. Batch Renormalization (see above).
        renorm_clipping: dict or `None`, default None; only with
            `renorm=True`. Optional keys "rmax", "rmin", "dmax" (floats);
            missing ones mean no clipping on that side (∞, 0, ∞).
        renorm_momentum: float in [0, 1), default 0.99; only with
            `renorm=True`. Momentum of `renorm_mean` and `renorm_stddev`.
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
        mask: optional boolean tensor of `inputs`' rank minus one (Keras'
            convention): the inputs' shape without the last axis, or
            broadcastable to it; it broadcasts over the last axis, whatever
            the feature axes. Masked-out values do not count towards the
            batch statistics (each feature counts its own unmasked values);
            a fully masked feature keeps its moving statistics. Inference
            ignores the mask.

    Returns:
        A tensor of the inputs' shape in the layer's `compute_dtype`.

    Raises:
        ValueError: for an invalid `axis`, `momentum`, `epsilon`,
            `renorm_clipping` or `renorm_momentum`, an axis out of range or an
            undefined feature dimension at build, a training batch whose
            statistics would be over a single value (m = 1) when that is known
            statically, a mask of the wrong rank, `synchronized=True` on
            PyTorch, `sync_group_size` < 1 or without `synchronized=True`,
            `virtual_batch_size` < 2, with `synchronized=True` or with the
            batch axis as a feature axis; at a training call a
            `sync_group_size` that does not divide the replica count, a
            `virtual_batch_size` that does not divide a replica's batch, or
            (`keras.distribution`) a batch that does not split evenly over
            the replicas.
        TypeError: for non-float inputs, non-bool flags or a non-int
            `sync_group_size` or `virtual_batch_size`.
        RuntimeError: when a synchronised call runs where its collective
            cannot (inside a `tf.function` nested in `strategy.run`).

    Reference:
        S. Ioffe and C. Szegedy, "Batch Normalization: Accelerating Deep
        Network Training by Reducing Internal Covariate Shift", ICML 2015,
        arXiv:1502.03167.
        E. Hoffer, I. Hubara and D. Soudry, "Train longer, generalize
        better: closing the generalization gap in large batch training of
        neural networks", NeurIPS 2017, arXiv:1705.08741.
        S. Ioffe, "Batch Renormalization: Towards Reducing Minibatch
        Dependence in Batch-Normalized Models", NeurIPS 2017,
        arXiv:1702.03275.
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
        virtual_batch_size=None,
        renorm=False,
        renorm_clipping=None,
        renorm_momentum=0.99,
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
        self.virtual_batch_size = _coerce_virtual_batch_size(
            virtual_batch_size, self.synchronized
        )
        self.renorm = _coerce_bool("renorm", renorm)
        self.renorm_clipping = _coerce_renorm_clipping(renorm_clipping, self.renorm)
        self.renorm_momentum = _coerce_momentum(
            renorm_momentum, "renorm_momentum", allow_none=False
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
        self.moving_stddev = None
        self.renorm_mean = None
        self.renorm_stddev = None
        self._feature_axes = None

    @property
    def feature_axes(self):
        """The feature axes as sorted non-negative ints (`None` before build)."""
        return self._feature_axes

    @property
    def statistics_dtype(self):
        """The dtype of the statistics, weights and arithmetic: float64 or float32."""
        return "float64" if self.variable_dtype == "float64" else "float32"

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
        if self.virtual_batch_size is not None and 0 in axes:
            raise ValueError(
                "virtual_batch_size splits the batch axis 0, which must then "
                "not be a feature axis. "
                f"Received: virtual_batch_size={self.virtual_batch_size}, axis={self.axis}"
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
                dtype=self.statistics_dtype,
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
                dtype=self.statistics_dtype,
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
        if self.renorm:
            # Stddevs start at √ of the variance initializer, as in Keras.
            variance_init = self.moving_variance_initializer

            def stddev_initializer(shape, dtype=None):
                return ops.sqrt(variance_init(shape, dtype=dtype))

            self.moving_stddev = self._statistic("moving_stddev", shape, stddev_initializer)
            self.renorm_mean = self._statistic(
                "renorm_mean", shape, self.moving_mean_initializer
            )
            self.renorm_stddev = self._statistic("renorm_stddev", shape, stddev_initializer)
        self.input_spec = keras.layers.InputSpec(
            ndim=rank, axes={a: input_shape[a] for a in self._feature_axes}
        )

    def _statistic(self, name, shape, initializer):
        with keras.name_scope(self.name, caller=self):
            return keras.Variable(
                initializer=initializer,
                shape=shape,
                dtype=self.statistics_dtype,
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
        dtype = self.statistics_dtype
        x = ops.cast(inputs, dtype)
        gamma = self._broadcast(self.gamma, 1.0)
        beta = self._broadcast(self.beta, 0.0)
        if training and self.trainable:
            y = self._normalize_in_training(x, gamma, beta, mask, inputs.shape)
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

    def _normalize_in_training(self, x, gamma, beta, mask, static_shape):
        """Normalises with batch statistics and updates the moving statistics."""
        weights = self._mask_weights(x, mask)
        if weights is None:
            self._check_static_count(static_shape)
        groups = self._replica_groups()
        axes = self._reduction_axes
        count_slices = 1
        if 0 in axes:
            count_slices = slices.count(
                x.shape[0],
                replicas=slices.data_parallel_replicas(),
                synchronized=self.synchronized,
                group_size=self.sync_group_size,
                virtual_batch_size=self.virtual_batch_size,
            )
        sliced = count_slices != 1
        if sliced:
            # Slices of the batch axis normalised on their own (ghost
            # batches, replicas under keras.distribution): a leading slice
            # axis, which the statistics do not reduce.
            x = self._check_divisible_batch(x)
            x = slices.split(x, count_slices, self.virtual_batch_size)
            if weights is not None:
                batch = ops.shape(x)[0] * ops.shape(x)[1]
                weights = ops.broadcast_to(weights, (batch, *weights.shape[1:]))
                weights = slices.split(weights, count_slices, self.virtual_batch_size)
            axes = (1,) + tuple(a + 1 for a in axes if a != 0)
            gamma = ops.expand_dims(gamma, 0)
            beta = ops.expand_dims(beta, 0)
        count, mean, variance = normalize.batch_moments(x, axes, weights, groups)
        if self.renorm:
            r, d = self._renorm_correction(mean, variance)
            beta = beta + gamma * d
            gamma = gamma * r
        y = normalize.normalize_with_batch_statistics(
            x, gamma, beta, mean, variance, count,
            axes=axes, epsilon=self.epsilon, weights=weights, groups=groups,
        )
        if sliced:
            y = slices.merge(y)
            count, mean, variance = slices.pool_moments(count, mean, variance)
        self._update_moving_statistics(
            self._flat(mean), self._flat(variance), self._flat_count(count)
        )
        return y

    def _check_divisible_batch(self, x):
        """`x`, checked (at run time) to split into ghost batches when its batch is dynamic.

        Only TensorFlow traces with an unknown batch size; the check comes
        before the reshape, whose own error would not name the ghost size.
        """
        if self.virtual_batch_size is None or x.shape[0] is not None:
            return x
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf  # A run-time check: the batch is only known then.

            batch = tf.shape(x)[0]
            check = tf.debugging.Assert(
                tf.equal(tf.math.floormod(batch, self.virtual_batch_size), 0),
                [f"virtual_batch_size={self.virtual_batch_size} must divide each replica's batch of", batch, "examples"],
            )
            with tf.control_dependencies([check]):
                return tf.identity(x)
        return x

    def _replica_groups(self):
        """The tf.distribute replica groups to synchronise over, else `None`.

        `None` for local statistics, and on JAX, where `keras.distribution`
        synchronises through slices of the global batch instead.
        """
        if not self.synchronized:
            return None
        backend = keras.backend.backend()
        if backend == "jax":
            return None
        if backend != "tensorflow":
            raise ValueError(
                "synchronized=True needs TensorFlow's tf.distribute or JAX's "
                f"keras.distribution and is not supported on the {backend} "
                "backend. Received: synchronized=True"
            )
        return moments.replica_groups(
            moments.sync_replica_context(), self.sync_group_size
        )

    def _broadcast(self, variable, default):
        dtype = self.statistics_dtype
        if variable is None:
            return ops.full(self._broadcast_shape, default, dtype=dtype)
        return ops.reshape(ops.cast(variable, dtype), self._broadcast_shape)

    def _flat(self, statistic):
        return ops.reshape(statistic, self.moving_mean.shape)

    def _flat_count(self, count):
        # One count for all features, or one per feature (masks over them).
        size = 1
        for dim in count.shape:
            size *= dim
        if size == 1:
            return ops.reshape(count, ())
        return self._flat(ops.broadcast_to(count, self._broadcast_shape))

    def _mask_weights(self, x, mask):
        """The mask as 0/1 weights of `x`'s rank, or `None` without a mask."""
        if mask is None:
            return None
        rank = len(x.shape)
        if len(mask.shape) != rank - 1:
            raise ValueError(
                "The mask must have one dimension less than the inputs "
                "(it broadcasts over their last axis). "
                f"Received: mask.shape={tuple(mask.shape)}, "
                f"inputs.shape={tuple(x.shape)}"
            )
        return ops.expand_dims(ops.cast(mask, x.dtype), -1)

    def _renorm_correction(self, mean, variance):
        """Batch Renormalization's (r, d), clipped and held out of the gradient."""
        dtype = self.statistics_dtype
        stddev = ops.sqrt(variance + self.epsilon)
        renorm_mean = self._broadcast(self.renorm_mean, 0.0)
        # σ_R at least √ε: no division by zero early in training.
        renorm_stddev = ops.maximum(
            self._broadcast(self.renorm_stddev, 1.0),
            ops.cast(self.epsilon, dtype) ** 0.5,
        )
        r = stddev / renorm_stddev
        d = (mean - renorm_mean) / renorm_stddev
        clipping = self.renorm_clipping or {}
        if "rmin" in clipping:
            r = ops.maximum(r, clipping["rmin"])
        if "rmax" in clipping:
            r = ops.minimum(r, clipping["rmax"])
        if "dmax" in clipping:
            d = ops.clip(d, -clipping["dmax"], clipping["dmax"])
        return ops.stop_gradient(r), ops.stop_gradient(d)

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
        """Moves the statistics towards a batch's (per feature where count > 0)."""
        batch_variance = variance
        if self.unbiased_variance:
            # m/(m−1) for m > 1; a single value carries no spread to correct.
            variance = variance * ops.where(
                count > 1.0, count / ops.maximum(count - 1.0, 1.0), 1.0
            )
        has_values = ops.cast(count > 0.0, mean.dtype)
        if self.momentum is None:
            # A batch counts once if any feature had values in it.
            batches = self.moving_batches + ops.max(has_values)
            rate = ops.divide_no_nan(has_values, batches)
            self.moving_batches.assign(batches)
        else:
            rate = (1.0 - self.momentum) * has_values

        def move(variable, value, rate=rate):
            variable.assign(variable * (1.0 - rate) + value * rate)

        move(self.moving_mean, mean)
        if not self.renorm:
            move(self.moving_variance, variance)
            return
        move(self.moving_stddev, ops.sqrt(variance + self.epsilon))
        self.moving_variance.assign(
            ops.relu(ops.square(self.moving_stddev) - self.epsilon)
        )
        renorm_rate = (1.0 - self.renorm_momentum) * has_values
        move(self.renorm_mean, mean, renorm_rate)
        move(self.renorm_stddev, ops.sqrt(batch_variance + self.epsilon), renorm_rate)

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
                "virtual_batch_size": self.virtual_batch_size,
                "renorm": self.renorm,
                "renorm_clipping": self.renorm_clipping,
                "renorm_momentum": self.renorm_momentum,
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


def _coerce_momentum(momentum, name="momentum", allow_none=True):
    if momentum is None and allow_none:
        return None
    kind = "a float or None" if allow_none else "a float"
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real):
        raise TypeError(
            f"Expected `{name}` to be {kind}. Received: {name}={momentum!r}"
        )
    momentum = float(momentum)
    if not 0.0 <= momentum < 1.0:
        raise ValueError(
            f"Expected `{name}` in [0, 1){' or None' if allow_none else ''}. "
            f"Received: {name}={momentum}"
        )
    return momentum


def _coerce_renorm_clipping(clipping, renorm):
    if clipping is None:
        return {} if renorm else None
    if not renorm:
        raise ValueError(
            "`renorm_clipping` only applies with renorm=True. "
            f"Received: renorm_clipping={clipping!r}, renorm=False"
        )
    if not isinstance(clipping, dict):
        raise TypeError(
            "Expected `renorm_clipping` to be a dict with keys among rmax, rmin, "
            f"dmax. Received: renorm_clipping={clipping!r}"
        )
    keys = ("rmax", "rmin", "dmax")
    if set(clipping) - set(keys):
        raise ValueError(
            "Received invalid keys for `renorm_clipping`: "
            f"{sorted(set(clipping) - set(keys))}; supported keys are {list(keys)}. "
            f"Received: renorm_clipping={clipping!r}"
        )
    for key, value in clipping.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
            raise TypeError(
                f"Expected `renorm_clipping[{key!r}]` to be a float. "
                f"Received: renorm_clipping={clipping!r}"
            )
    clipping = {key: float(value) for key, value in clipping.items()}
    if clipping.get("rmax", float("inf")) < clipping.get("rmin", 0.0):
        raise ValueError(
            "rmax should be greater than or equal to rmin in `renorm_clipping`. "
            f"Received: renorm_clipping={clipping!r}"
        )
    if clipping.get("dmax", 0.0) < 0.0:
        raise ValueError(
            "dmax should be non-negative in `renorm_clipping`. "
            f"Received: renorm_clipping={clipping!r}"
        )
    return clipping


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


def _coerce_optional_int(name, value, minimum, why=""):
    """None, or `value` as an int >= minimum; `why` explains the bound."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"Expected `{name}` to be an int or None. Received: {name}={value!r}"
        )
    if value < minimum:
        raise ValueError(
            f"Expected `{name}` >= {minimum}{why}. Received: {name}={value}"
        )
    return int(value)


def _coerce_group_size(group_size, synchronized):
    group_size = _coerce_optional_int("sync_group_size", group_size, 1)
    if group_size is not None and not synchronized:
        raise ValueError(
            "`sync_group_size` groups replicas for synchronised statistics and "
            "needs synchronized=True. "
            f"Received: sync_group_size={group_size}, synchronized=False"
        )
    return group_size


def _coerce_virtual_batch_size(size, synchronized):
    size = _coerce_optional_int(
        "virtual_batch_size", size, 2,
        " (a ghost batch of one example has no spread to normalise)",
    )
    if size is not None and synchronized:
        raise ValueError(
            "Ghost batches are sub-batches of one replica's batch, normalised "
            "on their own, while synchronized=True merges batches across "
            "replicas; use one or the other. "
            f"Received: virtual_batch_size={size}, synchronized=True"
        )
    return size


def _coerce_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"Expected `{name}` to be a bool. Received: {name}={value!r}")
    return value
