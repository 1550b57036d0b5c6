"""`keras_bn.BatchNormalization`: the layer of Ioffe & Szegedy (2015)."""

import keras
from keras import constraints
from keras import initializers
from keras import ops
from keras import regularizers

from keras_bn import batch_plan
from keras_bn import kernels
from keras_bn import moving_statistics
from keras_bn import normalize
from keras_bn import validation
from keras_bn import weight_files


@keras.saving.register_keras_serializable(package="keras_bn")
class BatchNormalization(keras.layers.Layer):
    """Batch normalization (Ioffe & Szegedy, 2015).

    In training (`training=True` and the layer trainable) each feature is
    normalised with the statistics of the current mini-batch, over every
    axis not in `axis` (a conv map `(N, H, W, C)` with `axis=-1` is
    normalised per channel over m = N·H·W values):

        μ_B = (1/m) Σ x_i,       σ²_B = (1/m) Σ (x_i − μ_B)²,
        x̂_i = (x_i − μ_B) / √(σ²_B + ε),    y_i = γ x̂_i + β.

    Gradients flow through μ_B and σ²_B. In inference (`training=False` or
    unset) the layer uses its moving statistics, so each example's output
    is independent of its batch companions:

        y = γ (x − moving_mean) / √(moving_variance + ε) + β.

    Moving statistics. With a float `momentum` (Keras' convention: the
    weight of the *old* value), after every training step

        moving_mean     = moving_mean · momentum + μ_B · (1 − momentum),
        moving_variance = moving_variance · momentum + v_B · (1 − momentum).

    With `momentum=None` they are the exact running averages over all
    training batches, each batch weighted equally (paper, Algorithm 2).
    v_B = σ²_B by default (as Keras), or m/(m−1)·σ²_B, the paper's unbiased
    estimate, with `unbiased_variance=True`; m counts the values behind a
    statistic (N·H·W for conv maps; the global m under synchronisation).
    A batch with one value per feature or none (m ≤ 1: a `fit` whose last
    batch holds one example, say) leaves that feature's statistics
    unchanged: one value says nothing about the variance. Its output is β
    (x − μ_B = 0; γ·d + β with renorm), as in Keras' layer, and it never
    raises.

    Non-finite batches. One batch that overflows (e.g. under `mixed_float16`,
    where the loss-scale optimizer then skips the step) would otherwise put
    NaN or inf into the moving statistics for good, and every later
    inference with them. With `skip_nonfinite_updates=True` (the default), a
    training batch whose mean or variance is not finite in any feature
    leaves all moving statistics unchanged (the decision is for the whole
    update, not per feature). The batch's own output is not altered: its
    loss is non-finite as it would be anyway. With
    `count_skipped_updates=True` the layer also counts the skips in the
    non-trainable weight `skipped_updates` (logged by `BatchNormMonitor`),
    and with them the batches of m ≤ 1 that moved no statistic.

    Weight files. By default the layer holds exactly Keras' weights in
    Keras' order, so weight files and `get_weights()` lists move between it
    and `keras.layers.BatchNormalization` both ways. Its own state
    (`moving_batches`, `num_updates`, `skipped_updates`, `accumulated_*`) is
    saved and loaded by name (0 when a file has none); a file with other
    numbers or shapes of weights is refused (a swap of `center` and `scale`
    cannot be told apart).

    Kernels. A call with one feature axis, the last or the second of a 4-D
    or 5-D map, and no mask, renorm, ghost batches or cross-replica merge
    runs through the engine's fused kernel where it was measured faster
    (TensorFlow's FusedBatchNormV3 on GPU and oneDNN CPUs, PyTorch's native
    kernel), else the general path (`keras_bn.kernels` holds the rule), in
    training and inference; a 16-bit input goes to it without a cast.

    Warm-up. With `momentum_warmup=True` the momentum of update t (the
    weight `num_updates`) is min(momentum, (1 + t)/(10 + t)), TensorFlow's
    `ExponentialMovingAverage(num_updates=...)` rule: early moving
    statistics follow the data instead of their initial values.

    Which examples share statistics. By default each replica's own batch.
    `synchronized=True` uses the global batch of all replicas under
    `tf.distribute` (`MirroredStrategy`, `MultiWorkerMirroredStrategy`,
    `TPUStrategy`) and under Keras 3's `keras.distribution` on JAX, or of
    consecutive groups of `sync_group_size` replicas. `virtual_batch_size=v`
    normalises consecutive ghost batches of v examples of each replica's
    batch on their own (Hoffer et al. 2017); the moving statistics move once
    per step towards the ghost batches' average mean and average variance.
    With `synchronized=True` too, v examples share statistics whatever the
    replica count: ghost batches of a replica's batch b when v < b, each
    replica's batch when v = b, groups of v / b replicas when v > b.
    Without a strategy or distribution the batch is the whole batch. Under
    `tf.distribute` each replica keeps its own copy of the moving
    statistics (identical when synchronised); a checkpoint holds their
    average. See the distributed-training docs for the collectives.

    Batch Renormalization (Ioffe 2017). With `renorm=True`, training uses
    y = γ (r x̂ + d) + β, r = σ_B / σ_R and d = (μ_B − μ_R) / σ_R, with μ_R,
    σ_R moving averages of μ_B and σ_B = √(σ²_B + ε) (`renorm_momentum`);
    r and d are clipped by `renorm_clipping` and held out of the gradient.
    `moving_variance` then follows an average of σ_B: moving_stddev² − ε.

    Which statistics normalise. `statistics="batch"` normalises with batch
    statistics in inference too (PyTorch's `track_running_stats=False`,
    Flax's `use_running_average=False`): an inference call normalises as a
    training call would (ghost batches and mask included) and moves
    nothing; training still moves the moving statistics, kept in weight
    files as ever. `statistics="moving"` freezes them (detectron2's
    `FrozenBatchNorm2d`): training normalises with the moving statistics
    and never moves them, x's gradient is the inference formula's, and γ
    and β still learn (`convert_batch_norm(model, statistics="moving")`).

    Gradient accumulation. With `accumulation_steps=k` each training call
    still normalises with its own batch statistics, and the moving
    statistics take one step per k calls, from the pooled moments of those
    k micro-batches (mean of means, mean of within-batch variances, as ghost
    batches of one step), so momentum and `momentum=None` count optimizer
    steps. The state lives in the weights `accumulated_*`; the layer counts
    its own training calls (one per optimizer micro-step keeps them aligned).

    Precision. Statistics and arithmetic are in float32 for float16,
    bfloat16 and float32 inputs, and in float64 for a float64 layer; the
    output is in the layer's `compute_dtype`. Integer inputs are cast to the
    statistics' dtype, as Keras does; boolean and complex inputs are refused.
    γ and β have the `variable_dtype` (16-bit under `dtype="bfloat16"` or
    `"float16"`); the moving statistics `statistics_dtype`, never 16-bit:
    there an update (1 − momentum)·(x − moving) below half a step rounds
    to nothing, and Keras' layer's bfloat16 ones stall (docs/layer.md).

    Backends. Everything runs on every Keras 3 backend but `synchronized`
    (TensorFlow, JAX). `trainable=False` means inference mode, as in Keras.
    Derivatives of any order, forward mode too, follow the batch statistics.

    Args:
        axis: int or list/tuple of ints, default -1. The feature axes, which
            keep their own statistics; e.g. `axis=1` for channels-first maps.
        momentum: float in [0, 1) or `None`, default 0.99. The weight of the
            old value in the moving averages; `None` selects the exact
            cumulative average.
        epsilon: float >= 0, default 1e-3. Added to the variance before the
            square root, also at inference.
        center: bool, default True. Adds the offset β.
        scale: bool, default True. Multiplies by γ; disable it when the next
            layer is linear (e.g. `relu`), which can absorb the scale.
        unbiased_variance: bool, default False. Accumulate m/(m−1)·σ²_B in
            the moving variance (paper) instead of σ²_B (Keras).
        synchronized: bool, default False. Normalise with the moments of
            the global batch across replicas.
        sync_group_size: int >= 1 or `None`, default None (all replicas).
            With `synchronized=True`, the replicas per group; it must divide
            the number of replicas in sync.
        virtual_batch_size: int >= 2 or `None`, default None. Ghost batch
            size in training; it must divide each replica's batch. With
            `synchronized=True`, the normalisation batch in examples: it
            must tile the global batch; not with `sync_group_size`.
        renorm: bool, default False. Batch Renormalization.
        renorm_clipping: dict or `None`, default None; only with
            `renorm=True`. Optional keys "rmax", "rmin", "dmax" (floats);
            missing ones mean no clipping on that side.
        renorm_momentum: float in [0, 1), default 0.99. Momentum of
            `renorm_mean` and `renorm_stddev`.
        skip_nonfinite_updates: bool, default True. Skip the update of a
            batch with non-finite statistics. Turn it off to let a
            non-finite batch show in the moving statistics while debugging.
        count_skipped_updates: bool, default False. Count the skipped
            updates in the non-trainable weight `skipped_updates` (one weight
            more than Keras' layer); needs `skip_nonfinite_updates=True`.
        momentum_warmup: bool, default False. Warm the momentum up over the
            first updates; needs a float `momentum`.
        statistics: str, default "batch_in_training". Which statistics
            normalise: batch statistics in training and moving ones in
            inference, batch statistics always ("batch"), or the moving
            statistics always ("moving", frozen). Not with `renorm=True`.
        accumulation_steps: int >= 2 or `None`, default None. Training calls
            per update of the moving statistics, as the optimizer's
            `gradient_accumulation_steps`; adds five accumulator weights.
        fused: bool or `None`, default None. `None` uses the engine's fused
            kernel where the rule above picks it, `False` never (the general
            path), `True` requires it (a `ValueError` where it cannot run).
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
        inputs: floating-point tensor of rank >= 1.
        training: bool. True normalises with batch statistics and updates
            the moving statistics; False or `None` uses the moving
            statistics (unless `statistics` says otherwise).
        mask: optional tensor of the inputs' rank minus one, of any dtype,
            which broadcasts over their last axis (Keras' convention); a
            value counts where the mask is non-zero, as in Keras. Masked-out
            values do not count towards the batch statistics; a fully
            masked feature keeps its moving statistics. Masked-out values,
            NaN or inf included, reach neither the statistics nor any
            other value's output. Inference ignores the mask.

    Returns:
        A tensor of the inputs' shape in the layer's `compute_dtype`.

    Raises:
        ValueError: for an invalid argument; at build for an axis out of
            range or an undefined feature dimension; for `synchronized=True`
            on PyTorch (at construction, as Keras' layer refuses it); in
            training for a mask of the wrong shape, a `sync_group_size`,
            `virtual_batch_size` or (`keras.distribution`) replica count
            that does not divide, and `fused=True` where no kernel runs the
            call (a training batch of one value per feature takes the
            general path instead); when loading a file of other weights.
        TypeError: for non-numeric inputs or an argument of the wrong type.
        RuntimeError: when a synchronised call runs where its collective
            cannot (a `tf.function` nested in `strategy.run`).

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
        skip_nonfinite_updates=True,
        count_skipped_updates=False,
        momentum_warmup=False,
        statistics="batch_in_training",
        accumulation_steps=None,
        fused=None,
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
        self.axis = validation.axis(axis)
        self.momentum = validation.momentum(momentum)
        self.epsilon = validation.epsilon(epsilon)
        self.center = validation.boolean("center", center)
        self.scale = validation.boolean("scale", scale)
        self.unbiased_variance = validation.boolean("unbiased_variance", unbiased_variance)
        self.synchronized = validation.synchronized(synchronized)
        self.sync_group_size = validation.sync_group_size(sync_group_size, synchronized)
        self.virtual_batch_size = validation.virtual_batch_size(virtual_batch_size, sync_group_size)
        self.renorm = validation.boolean("renorm", renorm)
        self.renorm_clipping = validation.renorm_clipping(renorm_clipping, renorm)
        self.renorm_momentum = validation.momentum(renorm_momentum, "renorm_momentum", False)
        guard = validation.nonfinite_guard(skip_nonfinite_updates, count_skipped_updates)
        self.skip_nonfinite_updates, self.count_skipped_updates = guard
        self.momentum_warmup = validation.momentum_warmup(momentum_warmup, self.momentum)
        self.statistics = validation.statistics(statistics, self.renorm)
        self.accumulation_steps = validation.accumulation_steps(accumulation_steps, statistics)
        self.fused = validation.optional_bool("fused", fused)
        self.beta_initializer = initializers.get(beta_initializer)
        self.gamma_initializer = initializers.get(gamma_initializer)
        self.moving_mean_initializer = initializers.get(moving_mean_initializer)
        self.moving_variance_initializer = initializers.get(moving_variance_initializer)
        self.beta_regularizer = regularizers.get(beta_regularizer)
        self.gamma_regularizer = regularizers.get(gamma_regularizer)
        self.beta_constraint = constraints.get(beta_constraint)
        self.gamma_constraint = constraints.get(gamma_constraint)
        self.supports_masking = True
        for name in _KERAS_WEIGHTS + _OWN_STATE + ("_feature_axes",):
            setattr(self, name, None)  # Set in build() as the settings ask.

    @property
    def feature_axes(self):
        """The feature axes as sorted non-negative ints (`None` before build)."""
        return self._feature_axes

    @property
    def statistics_dtype(self):
        """The dtype of the moving statistics and the arithmetic: float64 or float32.

        float64 for a float64 `variable_dtype`, else float32 (16-bit
        variable dtypes included); γ and β have `variable_dtype`.
        """
        return "float64" if self.variable_dtype == "float64" else "float32"

    def build(self, input_shape):
        rank = len(input_shape)
        self._feature_axes = self._resolve_axes(input_shape)
        self._reduction_axes = tuple(i for i in range(rank) if i not in self._feature_axes)
        shape = tuple(input_shape[a] for a in self._feature_axes)
        self._broadcast_shape = tuple(
            input_shape[i] if i in self._feature_axes else 1 for i in range(rank)
        )
        # Created in Keras' order (its get_weights() lists fit set_weights()), own counters last.
        if self.scale:
            self.gamma = self._parameter(
                "gamma",
                shape,
                self.gamma_initializer,
                self.gamma_regularizer,
                self.gamma_constraint,
            )
        if self.center:
            self.beta = self._parameter(
                "beta", shape, self.beta_initializer, self.beta_regularizer, self.beta_constraint
            )
        # Moving statistics are sync-on-read: each replica updates its own
        # copy with no communication (under synchronisation the copies are
        # identical), and a cross-replica read (checkpoint, export) averages.
        self.moving_mean = self._statistic("moving_mean", shape, self.moving_mean_initializer)
        self.moving_variance = self._statistic(
            "moving_variance", shape, self.moving_variance_initializer
        )
        if self.renorm:
            # Stddevs start at √ of the variance initializer, as in Keras.
            variance_init = self.moving_variance_initializer

            def stddev_initializer(shape, dtype=None):
                return ops.sqrt(variance_init(shape, dtype=dtype))

            self.moving_stddev = self._statistic("moving_stddev", shape, stddev_initializer)
            self.renorm_mean = self._statistic("renorm_mean", shape, self.moving_mean_initializer)
            self.renorm_stddev = self._statistic("renorm_stddev", shape, stddev_initializer)
        wanted = (self.momentum is None, self.momentum_warmup, self.count_skipped_updates)
        wanted += (self.accumulation_steps is not None,) * len(moving_statistics.ACCUMULATORS)
        for name, needed in zip(_OWN_STATE, wanted):
            # Counters are scalars, the accumulators (but their step count) per feature.
            per_feature = name in moving_statistics.ACCUMULATORS[1:]
            if needed:
                state = self._statistic(name, shape if per_feature else (), initializers.Zeros())
                setattr(self, name, state)
        self.input_spec = keras.layers.InputSpec(
            ndim=rank, axes={a: input_shape[a] for a in self._feature_axes}
        )

    def _resolve_axes(self, input_shape):
        """The feature axes of `input_shape`, sorted and non-negative, validated."""
        rank = len(input_shape)
        if any(not -rank <= a < rank for a in self.axis):
            raise ValueError(
                f"Axis out of range for inputs of rank {rank} (shape {tuple(input_shape)}). "
                f"Received: axis={self.axis}"
            )
        axes = sorted(a % rank for a in self.axis)
        if len(set(axes)) != len(axes):
            raise ValueError(
                "Axes must be distinct after resolving negative values for "
                f"rank {rank}. Received: axis={self.axis}"
            )
        if self.virtual_batch_size is not None and 0 in axes:
            raise ValueError(
                "virtual_batch_size splits the batch axis 0, which must then not be a feature "
                f"axis. Received: virtual_batch_size={self.virtual_batch_size}, axis={self.axis}"
            )
        for axis in axes:
            if input_shape[axis] is None:
                raise ValueError(
                    f"The feature axis {axis} must have a defined dimension. "
                    f"Received: input_shape={tuple(input_shape)}"
                )
        return tuple(axes)

    def _parameter(self, name, shape, initializer, regularizer, constraint):
        return self.add_weight(
            shape=shape,
            name=name,
            initializer=initializer,
            regularizer=regularizer,
            constraint=constraint,
            trainable=True,
            autocast=False,
            dtype=self.variable_dtype,
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
        x = self._numeric_input(inputs)
        training = bool(training and self.trainable)
        batch = self.statistics == "batch" or (training and self.statistics != "moving")
        if not batch:  # The moving statistics normalise.
            return batch_plan.cast(self._infer(x), self.compute_dtype)
        weights = validation.mask_weights(x, mask, self.statistics_dtype)
        plan = batch_plan.make_plan(
            batch_plan.current_context(self.synchronized),
            x.shape[0],
            batch_reduced=0 in self._reduction_axes,
            synchronized=self.synchronized,
            group_size=self.sync_group_size,
            virtual_batch_size=self.virtual_batch_size,
        )
        y, (count, mean, variance) = plan.normalize(
            x,
            *self._affine_weights(),
            reduction_axes=self._reduction_axes,
            epsilon=self.epsilon,
            broadcast_shape=self._broadcast_shape,
            weights=weights,
            correction=self._renorm_correction if self.renorm else None,
            fused=self.fused,
            dtype=self.statistics_dtype,
        )
        if training and not moving_statistics.recomputing():
            self._update_moving_statistics(count, mean, variance)
        return batch_plan.cast(y, self.compute_dtype)

    def _infer(self, x):
        statistics = [self.moving_mean, self.moving_variance, *self._affine_weights()]
        dtype, axes = self.statistics_dtype, self._reduction_axes
        kernel = kernels.choose(
            x, axes, self.epsilon, fused=self.fused, training=False, statistics=dtype
        )
        if kernel is not None:  # Per-feature vectors; γ, β may be None.
            return kernel.infer(x, *statistics, self.epsilon)
        statistics = [self._broadcast(v, d) for v, d in zip(statistics, (0.0, 1.0, 1.0, 0.0))]
        return normalize.normalize_with_statistics(
            batch_plan.cast(x, dtype), *statistics, self.epsilon
        )

    def _numeric_input(self, inputs):
        """Floats as they are (a kernel may take 16-bit ones), ints cast, bool/complex refused."""
        dtype = keras.backend.standardize_dtype(inputs.dtype)
        if keras.backend.is_float_dtype(dtype):
            # A tensor already after `Layer.__call__`'s conversion (its dispatch
            # costs an eager PyTorch call more than some of its operations).
            return inputs if ops.is_tensor(inputs) else ops.convert_to_tensor(inputs)
        if keras.backend.is_int_dtype(dtype):
            return ops.cast(inputs, self.statistics_dtype)
        raise TypeError(
            f"{type(self).__name__} needs real numeric inputs. Received: inputs.dtype={dtype}"
        )

    def _update_moving_statistics(self, count, mean, variance):
        """Moves the statistics towards a batch's pooled `(count, mean, variance)`."""
        rule = moving_statistics.Rule(
            momentum=self.momentum,
            unbiased_variance=self.unbiased_variance,
            epsilon=self.epsilon,
            renorm_momentum=self.renorm_momentum if self.renorm else None,
            skip_nonfinite=self.skip_nonfinite_updates,
            count_skipped=self.count_skipped_updates,
            momentum_warmup=self.momentum_warmup,
            accumulation_steps=self.accumulation_steps,
        )
        state = {name: v for name in _STATE if (v := getattr(self, name)) is not None}
        shape = self.moving_mean.shape
        if tuple(mean.shape) != tuple(shape):
            mean, variance = ops.reshape(mean, shape), ops.reshape(variance, shape)
        moving_statistics.assign(rule, state, mean, variance, self._flat_count(count))

    def _affine_weights(self):
        """γ and β (or None) in the statistics' dtype: 16-bit ones cast up."""
        dtype = self.statistics_dtype
        if self.variable_dtype == dtype:  # Every policy but the pure 16-bit ones.
            return [self.gamma, self.beta]
        return [None if v is None else batch_plan.cast(v, dtype) for v in (self.gamma, self.beta)]

    def _broadcast(self, variable, default):
        if variable is None:
            return ops.full(self._broadcast_shape, default, dtype=self.statistics_dtype)
        return ops.reshape(variable, self._broadcast_shape)  # In the statistics' dtype.

    def _flat_count(self, count):
        # One count for all features, or one per feature (masks over them).
        if isinstance(count, (int, float)):
            return count  # Known before run time (a fused kernel's).
        if len(count.shape) == 0 or all(d == 1 for d in count.shape):
            return ops.reshape(count, ())
        return ops.reshape(ops.broadcast_to(count, self._broadcast_shape), self.moving_mean.shape)

    def _renorm_correction(self, mean, variance):
        """Batch Renormalization's (r, d) of a slice's moments, against this layer's μ_R, σ_R."""
        renorm_mean = self._broadcast(self.renorm_mean, 0.0)
        renorm_stddev = self._broadcast(self.renorm_stddev, 1.0)
        return normalize.renorm_correction(
            mean, variance, renorm_mean, renorm_stddev, self.epsilon, self.renorm_clipping or {}
        )

    def save_own_variables(self, store):
        """Saves Keras' weights under Keras' numbered keys, this layer's own state by name."""
        weight_files.save(store, self._keras_weights(), self._own_state())

    def load_own_variables(self, store):
        """Loads a file of this layer or of Keras' layer: own state by name, shapes checked first.

        Raises:
            ValueError: when the file's numbered weights differ in number or
                shape from this layer's, or it holds an entry of neither kind.
        """
        weight_files.load(store, self._keras_weights(), self._own_state(), _OWN_STATE, self.name)

    def _own_state(self):
        return {n: getattr(self, n) for n in _OWN_STATE if getattr(self, n) is not None}

    def _keras_weights(self):
        return [getattr(self, n) for n in _KERAS_WEIGHTS if getattr(self, n) is not None]

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
                "skip_nonfinite_updates": self.skip_nonfinite_updates,
                "count_skipped_updates": self.count_skipped_updates,
                "momentum_warmup": self.momentum_warmup,
                "statistics": self.statistics,
                "accumulation_steps": self.accumulation_steps,
                "fused": self.fused,
                "beta_initializer": initializers.serialize(self.beta_initializer),
                "gamma_initializer": initializers.serialize(self.gamma_initializer),
                "moving_mean_initializer": initializers.serialize(self.moving_mean_initializer),
                "moving_variance_initializer": initializers.serialize(
                    self.moving_variance_initializer
                ),
                "beta_regularizer": regularizers.serialize(self.beta_regularizer),
                "gamma_regularizer": regularizers.serialize(self.gamma_regularizer),
                "beta_constraint": constraints.serialize(self.beta_constraint),
                "gamma_constraint": constraints.serialize(self.gamma_constraint),
            }
        )
        return config


# Keras' weights in Keras' order (its numbered file keys), then this layer's state, by name.
_KERAS_WEIGHTS = (
    "gamma",
    "beta",
    "moving_mean",
    "moving_variance",
    "moving_stddev",
    "renorm_mean",
    "renorm_stddev",
)
_OWN_STATE = ("moving_batches", "num_updates", "skipped_updates", *moving_statistics.ACCUMULATORS)
# What the update rule reads and writes: every non-trainable weight (all but γ and β).
_STATE = tuple(name for name in _KERAS_WEIGHTS if name not in ("gamma", "beta")) + _OWN_STATE
