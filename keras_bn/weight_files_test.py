"""Drop-in down to the weight file, on the current Keras backend.

A model built with `keras.layers.BatchNormalization` and the same model built
with `keras_bn.BatchNormalization` (default settings) load each other's
`.weights.h5` and `.keras` files, give equal outputs and train on; so does a
Keras application and its `convert_batch_norm` conversion. The layer's own
state (`skipped_updates`, `num_updates`, `moving_batches`) is saved by name:
kept by a round trip, 0 when a file has none, never read into another
variable. `.ci/run` runs this module under TensorFlow, JAX and PyTorch.
"""

import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np

import keras_bn
from tests import keras_features

FORMATS = (("weights_h5", ".weights.h5"), ("keras_archive", ".keras"))


def _data(shape, seed):
    return (np.random.RandomState(seed).randn(*shape) * 2.0 + 1.0).astype(np.float32)


def _model(norm, seed, dtype=None):
    """A conv map and a dense feature vector, each through a BN layer; every layer of `dtype`."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6, 6, 3))
    h = keras.layers.Conv2D(4, 3, use_bias=False, dtype=dtype)(inputs)
    h = norm(name="bn_conv", dtype=dtype)(h)
    h = keras.layers.Flatten(dtype=dtype)(keras.layers.ReLU(dtype=dtype)(h))
    h = keras.layers.Dense(5, dtype=dtype)(h)
    h = norm(name="bn_dense", momentum=0.9, center=False, dtype=dtype)(h)
    model = keras.Model(inputs, keras.layers.Dense(1, dtype=dtype)(h))
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


def _fit(model, seed=1):
    history = model.fit(
        _data((32, 6, 6, 3), seed), _data((32, 1), seed + 1), batch_size=8, verbose=0
    )
    return history.history["loss"]


def _save(model, suffix):
    path = os.path.join(tempfile.mkdtemp(), "model" + suffix)
    if suffix == ".keras":
        model.save(path)
    else:
        model.save_weights(path)
    return path


def _numpy_weights(layer):
    return [keras.ops.convert_to_numpy(w) for w in layer.weights]


def _predict(model):
    # In float32: NumPy 1.26 cannot compare bfloat16 arrays.
    y = keras.ops.convert_to_numpy(model(_data((8, 6, 6, 3), 9), training=False))
    return np.asarray(y, np.float32)


class WeightFileTest(parameterized.TestCase):
    def test_default_layer_holds_keras_weights_in_keras_order(self):
        ours, theirs = keras_bn.BatchNormalization(), keras.layers.BatchNormalization()
        for layer in (ours, theirs):
            layer.build((None, 4))
        self.assertEqual([w.name for w in ours.weights], [w.name for w in theirs.weights])
        if not keras_features.KERAS_HAS_RENORM:
            self.skipTest(keras_features.NO_KERAS_RENORM)
        renorm = [
            keras_bn.BatchNormalization(renorm=True),
            keras.layers.BatchNormalization(renorm=True),
        ]
        for layer in renorm:
            layer.build((None, 4))
        self.assertEqual(*[[w.name for w in layer.weights] for layer in renorm])

    @parameterized.named_parameters(*FORMATS)
    def test_keras_file_into_keras_bn_and_back(self, suffix):
        keras_model = _model(keras.layers.BatchNormalization, seed=0)
        _fit(keras_model)
        ours = _model(keras_bn.BatchNormalization, seed=3)
        ours.load_weights(_save(keras_model, suffix))
        np.testing.assert_allclose(_predict(ours), _predict(keras_model), rtol=1e-5, atol=1e-5)
        self.assertTrue(np.all(np.isfinite(_fit(ours, seed=5))))
        # And back: the trained keras_bn model's file into a fresh Keras model.
        fresh = _model(keras.layers.BatchNormalization, seed=4)
        fresh.load_weights(_save(ours, suffix))
        np.testing.assert_allclose(_predict(fresh), _predict(ours), rtol=1e-5, atol=1e-5)
        self.assertTrue(np.all(np.isfinite(_fit(fresh, seed=7))))

    @parameterized.named_parameters(*FORMATS)
    def test_bfloat16_files_both_ways(self, suffix):
        """Under dtype="bfloat16" Keras' statistics are bfloat16 and keras_bn's float32."""
        keras_model = _model(keras.layers.BatchNormalization, seed=0, dtype="bfloat16")
        _fit(keras_model)
        ours = _model(keras_bn.BatchNormalization, seed=3, dtype="bfloat16")
        ours.load_weights(_save(keras_model, suffix))
        for name in ("bn_conv", "bn_dense"):
            mine, theirs = ours.get_layer(name), keras_model.get_layer(name)
            self.assertEqual(
                [str(w.dtype) for w in mine.trainable_weights],
                ["bfloat16"] * len(mine.trainable_weights),
            )
            self.assertEqual([str(w.dtype) for w in mine.non_trainable_weights], ["float32"] * 2)
            for a, b in zip(_numpy_weights(mine), _numpy_weights(theirs)):  # Exact: widened.
                np.testing.assert_array_equal(a.astype(np.float32), b.astype(np.float32))
        # Both normalise in float32 and round the output to bfloat16 (2⁻⁸ relative).
        np.testing.assert_allclose(_predict(ours), _predict(keras_model), rtol=2e-2, atol=2e-2)
        self.assertTrue(np.all(np.isfinite(_fit(ours, seed=5))))
        # And back: Keras' layer reads the float32 statistics rounded to bfloat16.
        fresh = _model(keras.layers.BatchNormalization, seed=4, dtype="bfloat16")
        fresh.load_weights(_save(ours, suffix))
        for name in ("bn_conv", "bn_dense"):
            mine, theirs = ours.get_layer(name), fresh.get_layer(name)
            for a, b in zip(_numpy_weights(mine), _numpy_weights(theirs)):
                # Compared in float32: NumPy 1.26 cannot compare bfloat16 arrays.
                np.testing.assert_array_equal(
                    a.astype("bfloat16").astype(np.float32), b.astype(np.float32)
                )
        np.testing.assert_allclose(_predict(fresh), _predict(ours), rtol=2e-2, atol=2e-2)

    def test_keras_application_weights_into_its_conversion_and_back(self):
        def application(seed):
            keras.utils.set_random_seed(seed)
            return keras.applications.MobileNetV2(
                input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=4
            )

        original = application(0)
        x = _data((4, 32, 32, 3), 2)
        # A training call moves the moving statistics; eager, it compiles nothing (a
        # `fit` step compiled the whole network: 39 s under JAX in CI on 2 cores).
        original(x, training=True)
        moved = [la.moving_mean for la in original.layers if hasattr(la, "moving_mean")]
        self.assertTrue(all(np.any(keras.ops.convert_to_numpy(m) != 0) for m in moved))
        converted = keras_bn.convert_batch_norm(application(1))
        bn_layers = [la for la in converted.layers if isinstance(la, keras_bn.BatchNormalization)]
        self.assertLen(bn_layers, 52)
        converted.load_weights(_save(original, ".weights.h5"))
        expected = keras.ops.convert_to_numpy(original(x, training=False))
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(converted(x, training=False)), expected, rtol=1e-4, atol=1e-5
        )
        back = application(2)
        back.load_weights(_save(converted, ".weights.h5"))
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(back(x, training=False)), expected, rtol=1e-4, atol=1e-5
        )

    @parameterized.named_parameters(*FORMATS)
    def test_skipped_updates_count_is_kept_by_name(self, suffix):
        def counting(seed):
            return _model(
                lambda **kw: keras_bn.BatchNormalization(count_skipped_updates=True, **kw), seed
            )

        model = counting(0)
        _fit(model)
        layer = model.get_layer("bn_dense")
        layer(np.full((4, 5), np.nan, np.float32), training=True)  # Skipped, counted.
        self.assertEqual(float(keras.ops.convert_to_numpy(layer.skipped_updates)), 1.0)
        restored = counting(1)
        restored.load_weights(_save(model, suffix))
        counts = {
            name: float(keras.ops.convert_to_numpy(restored.get_layer(name).skipped_updates))
            for name in ("bn_conv", "bn_dense")
        }
        self.assertEqual(counts, {"bn_conv": 0.0, "bn_dense": 1.0})
        np.testing.assert_allclose(_predict(restored), _predict(model), rtol=1e-6)
        # A Keras file has no count: it restarts at 0, the statistics load.
        keras_model = _model(keras.layers.BatchNormalization, seed=2)
        _fit(keras_model)
        restored.load_weights(_save(keras_model, suffix))
        self.assertEqual(
            float(keras.ops.convert_to_numpy(restored.get_layer("bn_dense").skipped_updates)), 0.0
        )
        np.testing.assert_allclose(_predict(restored), _predict(keras_model), rtol=1e-5, atol=1e-5)

    def test_own_state_is_matched_by_name_not_position(self):
        counting = keras_bn.BatchNormalization(count_skipped_updates=True)
        warming = keras_bn.BatchNormalization(momentum_warmup=True)
        for layer in (counting, warming):
            layer.build((None, 3))
        counting.skipped_updates.assign(7.0)
        warming.num_updates.assign(3.0)
        store = {}
        counting.save_own_variables(store)
        self.assertEqual(sorted(store), ["0", "1", "2", "3", "skipped_updates"])
        warming.load_own_variables(store)
        # Five variables each, but skipped_updates never lands in num_updates.
        self.assertEqual(float(keras.ops.convert_to_numpy(warming.num_updates)), 0.0)

    def test_a_file_of_other_settings_is_refused_with_both_lists(self):
        renorm = keras_bn.BatchNormalization(renorm=True)
        plain = keras_bn.BatchNormalization()
        for layer in (renorm, plain):
            layer.build((None, 3))
        store = {}
        renorm.save_own_variables(store)
        with self.assertRaisesRegex(
            ValueError,
            r"expects the weights \['gamma', 'beta', 'moving_mean', 'moving_variance'\].*"
            r"Received: keys=\['0', '1', '2', '3', '4', '5', '6'\]",
        ):
            plain.load_own_variables(store)
        wider = keras_bn.BatchNormalization()
        wider.build((None, 5))
        before = _numpy_weights(plain)
        with self.assertRaisesRegex(ValueError, r"of shapes \[\(3,\).*shapes=\[\(5,\)"):
            plain.load_own_variables({str(i): w for i, w in enumerate(wider.weights)})
        for a, b in zip(_numpy_weights(plain), before):
            np.testing.assert_array_equal(a, b)  # Nothing assigned before the refusal.
        with self.assertRaisesRegex(ValueError, r"Received: keys=.*'momentum_of_mine'"):
            plain.load_own_variables(
                {**{str(i): store[str(i)] for i in range(4)}, "momentum_of_mine": 1}
            )


if __name__ == "__main__":
    absltest.main()
