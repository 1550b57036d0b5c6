"""Synchronised moments under MirroredStrategy on logical CPU devices."""

import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized

from tests import sync_fixtures

sync_fixtures.split_cpu(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_bn import batch_normalization  # noqa: E402
from keras_bn import batch_plan  # noqa: E402
from keras_bn import moments  # noqa: E402
from tests import references  # noqa: E402

BatchNormalization = batch_normalization.BatchNormalization


def _per_replica(strategy, parts):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(parts[ctx.replica_id_in_sync_group])
    )


def _split(array, sizes):
    return np.split(array, np.cumsum(sizes)[:-1])


def _layer_step(layer):
    """Forward + gradients of sum(y * w) for one replica's part."""

    def step(x, w, m=None):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True, mask=m)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * w)
        dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma, layer.beta])
        return y, dx, dgamma, dbeta

    return step


def _single_device(shape_kwargs, x, w, steps, mask=None, **kwargs):
    layer = BatchNormalization(**shape_kwargs, **kwargs)
    step = _layer_step(layer)
    for _ in range(steps):
        out = step(tf.constant(x), tf.constant(w), None if mask is None else tf.constant(mask))
    return layer, [o.numpy() for o in out]


def _mirrored(num_replicas, sizes, shape_kwargs, x, w, steps, mask=None, **kwargs):
    strategy = sync_fixtures.mirrored_cpu_strategy(num_replicas)
    with strategy.scope():
        layer = BatchNormalization(synchronized=True, **shape_kwargs, **kwargs)
        layer.build((None,) + x.shape[1:])
    step = tf.function(_layer_step(layer))
    args = [_per_replica(strategy, _split(x, sizes)), _per_replica(strategy, _split(w, sizes))]
    if mask is not None:
        args.append(_per_replica(strategy, _split(mask, sizes)))
    for _ in range(steps):
        y, dx, dgamma, dbeta = strategy.run(step, args=tuple(args))
    unwrap = strategy.experimental_local_results
    outputs = [
        np.concatenate([t.numpy() for t in unwrap(y)]),
        np.concatenate([t.numpy() for t in unwrap(dx)]),
        strategy.reduce("SUM", dgamma, axis=None).numpy(),
        strategy.reduce("SUM", dbeta, axis=None).numpy(),
    ]
    return strategy, layer, outputs


def _replica_copies(variable):
    """Each replica's copy of a sync-on-read moving statistic."""
    return [v.numpy() for v in variable.value.values]


def _data(shape, seed, loc=1.0, scale=2.0):
    rng = np.random.RandomState(seed)
    x = (rng.randn(*shape) * scale + loc).astype(np.float32)
    w = rng.randn(*shape).astype(np.float32)
    return x, w


class MirroredTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("two_equal", 2, [8, 8], (16, 5), {}),
        ("four_equal", 4, [4, 4, 4, 4], (16, 5), {}),
        ("two_unequal", 2, [11, 5], (16, 5), {}),
        ("four_one_empty", 4, [6, 0, 7, 3], (16, 5), {}),
        ("conv_two", 2, [3, 5], (8, 4, 4, 3), {}),
        ("conv_channels_first_four", 4, [2, 2, 1, 3], (8, 3, 4, 5), {"axis": 1}),
    )
    def test_matches_single_device_on_global_batch(self, num_replicas, sizes, shape, shape_kwargs):
        x, w = _data(shape, sum(sizes) + num_replicas)
        for unbiased in (False, True):
            kwargs = dict(momentum=0.7, unbiased_variance=unbiased)
            reference, expected = _single_device(shape_kwargs, x, w, steps=2, **kwargs)
            _, layer, actual = _mirrored(num_replicas, sizes, shape_kwargs, x, w, steps=2, **kwargs)
            for name, a, e in zip(("y", "dx", "dgamma", "dbeta"), actual, expected):
                np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5, err_msg=name)
            for variable, ref in (
                (layer.moving_mean, reference.moving_mean),
                (layer.moving_variance, reference.moving_variance),
            ):
                copies = _replica_copies(variable)
                self.assertLen(copies, num_replicas)
                for copy in copies:
                    np.testing.assert_array_equal(copy, copies[0])
                np.testing.assert_allclose(copies[0], ref.numpy(), rtol=1e-5, atol=1e-6)

    @parameterized.named_parameters(
        ("groups_of_1", 1, [4, 4, 4, 4]),
        ("groups_of_2", 2, [4, 4, 4, 4]),
        ("groups_of_4", 4, [4, 4, 4, 4]),
        ("groups_of_2_unequal_and_empty", 2, [3, 0, 5, 2]),
        ("groups_of_2_empty_group_member_last", 2, [2, 6, 4, 0]),
    )
    def test_groups_match_single_device_on_each_group_batch(self, group_size, sizes):
        x, w = _data((sum(sizes), 5), 20 + group_size, loc=3.0)
        self._check_groups(
            4, group_size, sizes, x, w, None, {}, dict(momentum=0.6, unbiased_variance=True)
        )

    @parameterized.named_parameters(
        (
            "renorm_all",
            4,
            None,
            False,
            {"renorm": True, "renorm_clipping": {"rmax": 1.2, "dmax": 0.2}},
        ),
        (
            "renorm_groups",
            4,
            2,
            False,
            {"renorm": True, "renorm_clipping": {"rmin": 0.9, "dmax": 0.1}},
        ),
        ("masked_channels_first_packed", 2, None, True, {}),
        ("masked_channels_first_all", 4, None, True, {}),
        ("masked_channels_first_groups", 4, 2, True, {}),
        ("masked_renorm_groups", 4, 2, True, {"renorm": True, "renorm_clipping": {"rmax": 1.1}}),
    )
    def test_renorm_and_masks_match_single_device(self, num_replicas, group_size, masked, kwargs):
        # Channels first (axis=1) with the mask over it: per-channel counts.
        sizes = [3, 1, 2, 4][:num_replicas]
        x, w = _data((sum(sizes), 3, 4), 30 + num_replicas, loc=2.0, scale=3.0)
        mask = np.random.RandomState(31).rand(sum(sizes), 3) > 0.3 if masked else None
        self._check_groups(
            num_replicas,
            group_size,
            sizes,
            x,
            w,
            mask,
            {"axis": 1},
            dict(momentum=0.5, renorm_momentum=0.7, **kwargs)
            if kwargs.get("renorm")
            else dict(momentum=0.5, **kwargs),
        )

    def _check_groups(self, num_replicas, group_size, sizes, x, w, mask, shape_kwargs, kwargs):
        """Each group's replicas equal one device on the group's batch."""
        _, layer, actual = _mirrored(
            num_replicas,
            sizes,
            shape_kwargs,
            x,
            w,
            steps=2,
            mask=mask,
            sync_group_size=group_size,
            **kwargs,
        )
        k = group_size or num_replicas
        bounds = np.cumsum([0] + sizes)
        expected = [[], [], 0.0, 0.0]
        statistics = {
            name: [] for name in ("moving_mean", "moving_variance", "renorm_mean", "renorm_stddev")
        }
        for g in range(num_replicas // k):
            lo, hi = bounds[g * k], bounds[(g + 1) * k]
            reference, (y, dx, dgamma, dbeta) = _single_device(
                shape_kwargs,
                x[lo:hi],
                w[lo:hi],
                steps=2,
                mask=None if mask is None else mask[lo:hi],
                **kwargs,
            )
            expected[0].append(y)
            expected[1].append(dx)
            expected[2] = expected[2] + dgamma
            expected[3] = expected[3] + dbeta
            for name, values in statistics.items():
                if getattr(reference, name) is not None:
                    values += [getattr(reference, name).numpy()] * k
        expected[0], expected[1] = np.concatenate(expected[0]), np.concatenate(expected[1])
        for name, a, e in zip(("y", "dx", "dgamma", "dbeta"), actual, expected):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5, err_msg=name)
        for name, refs in statistics.items():
            if refs:
                for replica, (copy, ref) in enumerate(
                    zip(_replica_copies(getattr(layer, name)), refs)
                ):
                    np.testing.assert_allclose(
                        copy, ref, rtol=1e-5, atol=1e-6, err_msg=f"{name} replica {replica}"
                    )

    @parameterized.named_parameters(
        ("four_groups_of_4", 4, 2),
        ("four_each_replica", 4, 8),
        ("four_ghost", 4, 32),
        ("two_groups_of_2", 2, 4),
    )
    def test_normalisation_batch_in_examples(self, num_replicas, per_replica):
        """synchronized=True, virtual_batch_size=8: every 8 consecutive examples, any b."""
        batch = num_replicas * per_replica
        rng = np.random.RandomState(per_replica)
        # Every 4 examples their own offset: each choice of 8 gives other statistics.
        offsets = np.repeat(np.arange(batch // 4) * 1.5, 4)[:, None]
        x = (rng.randn(batch, 5) * 2.0 + offsets).astype(np.float32)
        w = rng.randn(batch, 5).astype(np.float32)
        _, layer, actual = _mirrored(
            num_replicas,
            [per_replica] * num_replicas,
            {},
            x,
            w,
            1,
            momentum=0.5,
            virtual_batch_size=8,
        )
        expected = references.reference_sliced_batch_norm(x, w, 1.0, 0.0, batch // 8, 1e-3)
        for name, value in zip(("y", "dx", "dgamma", "dbeta"), actual):
            np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-5, err_msg=name)
        # The checkpointed value: the replicas' copies averaged.
        np.testing.assert_allclose(layer.moving_mean.numpy(), 0.5 * expected["mean"], atol=1e-5)
        np.testing.assert_allclose(
            layer.moving_variance.numpy(), 0.5 + 0.5 * expected["variance"], rtol=1e-5
        )

    def test_normalisation_batch_that_does_not_tile_is_refused(self):
        x, w = _data((16, 3), 22)
        with self.assertRaisesRegex(
            ValueError, r"Received: virtual_batch_size=12, per-replica batch=4, replicas=4"
        ):
            _mirrored(4, [4] * 4, {}, x, w, steps=1, virtual_batch_size=12)  # Groups of 3.

    @parameterized.named_parameters(("local", False), ("synchronized", True))
    def test_accumulation_in_fit_takes_one_step_per_k_batches(self, synchronized):
        """accumulation_steps=2 over 4 replicas: one update per 2 batches, replicas alike.

        The optimizer does not accumulate here: Keras 3.15's
        `gradient_accumulation_steps` fails under MirroredStrategy for any
        model (`merge_call` inside its `ops.cond`); a custom loop that
        accumulates gradients itself pairs with the layer as `fit` does.
        """
        strategy, per_replica = sync_fixtures.mirrored_cpu_strategy(4), 2
        rng = np.random.RandomState(4)
        x = (rng.randn(64, 5) * 2.0 + np.repeat(np.arange(32) * 1.5, 2)[:, None]).astype(np.float32)
        data = tf.data.Dataset.from_tensor_slices((x, np.zeros((64, 1), np.float32))).batch(8)
        with strategy.scope():
            model = keras.Sequential(
                [
                    keras.Input((5,)),
                    BatchNormalization(
                        accumulation_steps=2, momentum=None, synchronized=synchronized, name="bn"
                    ),
                    keras.layers.Dense(1),
                ]
            )
            model.compile(keras.optimizers.SGD(0.01), "mse")
        model.fit(data, verbose=0)
        bn = model.get_layer("bn")
        self.assertEqual(float(bn.moving_batches.numpy()), 4.0)  # 8 batches, 2 per update.
        # Each replica's 2 examples (or the global 8) are a slice; the merges average.
        slices = x.astype(np.float64).reshape(-1, 8 if synchronized else per_replica, 5)
        np.testing.assert_allclose(bn.moving_mean.numpy(), slices.mean(1).mean(0), rtol=1e-5)
        np.testing.assert_allclose(bn.moving_variance.numpy(), slices.var(1).mean(0), rtol=1e-5)

    def test_group_size_must_divide_replica_count(self):
        x, w = _data((8, 3), 21)
        with self.assertRaisesRegex(
            ValueError, r"sync_group_size=3 must divide the 4 replicas in sync"
        ):
            _mirrored(4, [2, 2, 2, 2], {}, x, w, steps=1, sync_group_size=3)

    def test_collective_that_cannot_run_gets_a_clear_error(self):
        # MirroredStrategy raises this from merge_call when its collective is
        # reached inside a tf.function nested in strategy.run (the trainer's
        # jit_compile=True forward pass over logical CPUs); the layer says
        # what that means for it.
        class NestedFunctionContext(sync_fixtures.CountingReplicaContext):
            def all_reduce(self, reduce_op, value):
                raise RuntimeError(
                    "`merge_call` called while defining a new graph or a tf.function."
                )

        layer = BatchNormalization(synchronized=True)
        layer.build((4, 3))
        context = batch_plan.EngineContext(replica_context=NestedFunctionContext(2))
        with sync_fixtures.engine_context(context):
            with self.assertRaisesRegex(
                RuntimeError, r"cannot all-reduce its moments here because"
            ):
                layer(np.ones((4, 3), np.float32), training=True)

    def test_masked_and_mixed_precision(self):
        x, w = _data((4, 6, 3), 5)
        mask = np.random.RandomState(6).rand(4, 6) > 0.4
        _, expected = _single_device({}, x, w, steps=1, mask=mask)
        _, _, actual = _mirrored(2, [1, 3], {}, x, w, steps=1, mask=mask)
        for a, e in zip(actual, expected):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        try:
            _, layer, (y, *_) = _mirrored(2, [2, 2], {}, x, w, steps=1, momentum=0.0)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        self.assertEqual(y.dtype, tf.bfloat16.as_numpy_dtype)
        x_low = tf.cast(tf.cast(x, tf.bfloat16), tf.float32).numpy().astype(np.float64)
        np.testing.assert_allclose(
            _replica_copies(layer.moving_mean)[1], x_low.mean((0, 1)), rtol=1e-5, atol=1e-6
        )

    @parameterized.named_parameters(
        ("packed_two", 2, [5, 3], None, {}),
        ("all_four_one_empty", 4, [3, 0, 4, 1], None, {}),
        ("groups_of_two", 4, [2, 2, 3, 1], 2, {}),
        ("renorm", 2, [4, 4], None, {"renorm": True, "renorm_clipping": {"rmax": 1.2}}),
        ("dense_rows", 4, [16, 8, 8, 32], None, {}),
    )
    def test_merged_moments_kernel_matches_the_general_path(
        self, num_replicas, sizes, group_size, kwargs
    ):
        # fused=True takes the kernel's ops after the merge wherever they run
        # (the rule only on large inputs); fused=False the general path.
        shape = (sum(sizes), 8) if sum(sizes) > 16 else (sum(sizes), 3, 3, 4)
        x, w = _data(shape, 40 + num_replicas, loc=2.0, scale=3.0)
        results = {}
        for fused in (True, False):
            _, layer, outputs = _mirrored(
                num_replicas,
                sizes,
                {},
                x,
                w,
                steps=2,
                fused=fused,
                momentum=0.5,
                sync_group_size=group_size,
                **kwargs,
            )
            statistics = [_replica_copies(v) for v in (layer.moving_mean, layer.moving_variance)]
            results[fused] = outputs + [np.stack(s) for s in statistics]
        names = ("y", "dx", "dgamma", "dbeta", "moving_mean", "moving_variance")
        for name, a, e in zip(names, results[True], results[False]):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5, err_msg=name)

    @parameterized.named_parameters(
        ("packed_two", 2, [40, 24], None),
        ("two_pass_four", 4, [20, 12, 0, 32], None),
        ("groups_of_two", 4, [20, 12, 0, 32], 2),
    )
    def test_large_mean_variance_is_precise_at_first_step(self, num_replicas, sizes, group_size):
        rng = np.random.RandomState(7)
        x = (1e4 + rng.randn(64, 8)).astype(np.float32)
        w = np.zeros_like(x)
        _, layer, _ = _mirrored(
            num_replicas, sizes, {}, x, w, steps=1, momentum=0.0, sync_group_size=group_size
        )
        copies = _replica_copies(layer.moving_variance)
        bounds = np.cumsum([0] + sizes)
        k = group_size or num_replicas
        for replica, copy in enumerate(copies):
            g = replica // k
            expected = x[bounds[g * k] : bounds[(g + 1) * k]].astype(np.float64).var(0)
            np.testing.assert_allclose(copy, expected, rtol=1e-3, err_msg=f"replica {replica}")

    def test_checkpoint_restores_moving_statistics(self):
        x, w = _data((8, 4), 8)
        strategy, layer, _ = _mirrored(2, [4, 4], {}, x, w, steps=2, momentum=0.5)
        path = tf.train.Checkpoint(layer=layer).save(os.path.join(tempfile.mkdtemp(), "ckpt"))
        with strategy.scope():
            restored = BatchNormalization(synchronized=True, momentum=0.5)
            restored.build((None, 4))
        tf.train.Checkpoint(layer=restored).restore(path).assert_existing_objects_matched()
        for a, b in (
            (layer.moving_mean, restored.moving_mean),
            (layer.moving_variance, restored.moving_variance),
        ):
            for copy in _replica_copies(b):
                np.testing.assert_array_equal(copy, _replica_copies(a)[0])

    def test_falls_back_to_local_moments_outside_replica_context(self):
        x, w = _data((8, 4), 9)
        _, expected = _single_device({}, x, w, steps=1)
        layer = BatchNormalization(synchronized=True)
        actual = _layer_step(layer)(tf.constant(x), tf.constant(w))
        for a, e in zip(actual, expected):
            np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6)
        with sync_fixtures.mirrored_cpu_strategy(
            2
        ).scope():  # Cross-replica context: local moments.
            layer = BatchNormalization(synchronized=True)
            np.testing.assert_allclose(layer(x, training=True), expected[0], rtol=1e-6, atol=1e-6)

    def test_keras_fit_under_strategy(self):
        strategy = sync_fixtures.mirrored_cpu_strategy(2)
        x, _ = _data((8, 6, 6, 3), 10)
        y = np.random.RandomState(11).randint(0, 4, size=8)
        with strategy.scope():
            model = keras.Sequential(
                [
                    keras.Input((6, 6, 3)),
                    keras.layers.Conv2D(4, 3, use_bias=False),
                    BatchNormalization(synchronized=True),
                    keras.layers.ReLU(),
                    keras.layers.GlobalAveragePooling2D(),
                    keras.layers.Dense(4),
                ]
            )
            model.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        history = model.fit(x, y, batch_size=8, epochs=3, verbose=0)
        self.assertTrue(np.all(np.isfinite(history.history["loss"])))
        copies = _replica_copies(model.layers[1].moving_mean)
        np.testing.assert_array_equal(copies[0], copies[1])
        self.assertFalse(np.allclose(copies[0], 0.0))


class XlaTest(parameterized.TestCase):
    """The synchronised path compiled with XLA (static shapes, as on TPUs)."""

    @parameterized.named_parameters(
        ("dense_packed", (16, 5), (0,), 2, None, 2),
        ("conv_two_pass", (4, 5, 5, 3), (0, 1, 2), 8, None, 3),
        ("conv_groups", (4, 5, 5, 3), (0, 1, 2), 8, 4, 3),
    )
    def test_sync_path_compiles_and_matches_local(
        self, shape, axes, replicas, group_size, collectives
    ):
        x, w = _data(shape, 12)
        gamma = tf.constant(
            np.random.RandomState(13).rand(*([1] * (len(shape) - 1) + [shape[-1]])) + 0.5,
            tf.float32,
        )
        beta = tf.zeros_like(gamma)

        def run(groups):
            @tf.function(jit_compile=True)
            def step(x):
                with tf.GradientTape() as tape:
                    tape.watch([x, gamma, beta])
                    # The plan's own sequence, on the general path (no slices).
                    y, (count, mean, variance) = batch_plan.BatchPlan(groups=groups).normalize(
                        x, gamma, beta, reduction_axes=axes, epsilon=1e-3, fused=False
                    )
                    loss = tf.reduce_sum(y * w)
                return [y, mean, variance, count] + tape.gradient(loss, [x, gamma, beta])

            return [t.numpy() for t in step(tf.constant(x))]

        context = sync_fixtures.CountingReplicaContext(replicas, replica_id=replicas - 1)
        synced = run(moments.ReplicaGroups(context, group_size))
        # Forward one collective (packed, R = 2) or two, backward one.
        self.assertLen(context.floats, collectives)
        for a, b in zip(synced, run(None)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


class PayloadTest(parameterized.TestCase):
    """All-reduce traffic of one layer's training step, counted from its code path."""

    @parameterized.named_parameters(
        # (replicas, group size, forward floats, backward floats) for C channels.
        ("all_two", 2, None, lambda c: [2 * (2 * c + 1)], lambda c: [2 * c]),
        ("all_eight", 8, None, lambda c: [c + 1, 2 * c], lambda c: [2 * c]),
        ("all_1024", 1024, None, lambda c: [c + 1, 2 * c], lambda c: [2 * c]),
        ("groups_of_two", 8, 2, lambda c: [4 * (c + 1), 4 * c], lambda c: [4 * 2 * c]),
        ("groups_of_eight", 64, 8, lambda c: [8 * (c + 1), 8 * c], lambda c: [8 * 2 * c]),
        ("groups_of_one", 8, 1, lambda c: [], lambda c: []),
    )
    def test_counts(self, replicas, group_size, forward, backward):
        channels = 6
        layer = BatchNormalization(synchronized=True, sync_group_size=group_size)
        x = tf.constant(_data((4, 3, 3, channels), 14)[0])
        forward_floats, backward_floats = sync_fixtures.count_all_reduces(layer, x, replicas)
        self.assertEqual(forward_floats, forward(channels))
        self.assertEqual(backward_floats, backward(channels))
        if group_size is None:
            self.assertLessEqual(sum(forward_floats), 4 * channels + 4)
        else:
            self.assertLessEqual(sum(forward_floats), replicas // group_size * (2 * channels + 2))


if __name__ == "__main__":
    absltest.main()
