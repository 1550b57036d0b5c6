"""Tests of keras_bn.convert_batch_norm."""

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest

import keras_bn
from keras_bn import population
from tests import keras_features
from tests import sync_fixtures


def _bn_classes(model):
    found = []

    def visit(layer):
        if isinstance(layer, (keras.layers.BatchNormalization, keras_bn.BatchNormalization)):
            found.append(type(layer))
        for child in getattr(layer, "layers", ()):
            visit(child)

    visit(model)
    return found


def _train_one_step(model, x, classes):
    model.compile(
        keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    y = np.arange(len(x)) % classes
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)


def _nested_model():
    # With renorm where the installed Keras' layer takes it (keras_features).
    renorm = {"renorm": True, "renorm_clipping": {"rmax": 2.0}}
    inner = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(5, use_bias=False),
            keras.layers.BatchNormalization(
                momentum=0.5, name="inner_bn", **(renorm if keras_features.KERAS_HAS_RENORM else {})
            ),
        ],
        name="inner",
    )
    inputs = keras.Input((4, 4, 3))
    h = keras.layers.Conv2D(6, 3, use_bias=False)(inputs)
    h = keras.layers.BatchNormalization(momentum=0.5, epsilon=1e-4, name="conv_bn")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = inner(h)
    outputs = keras_bn.BatchNormalization(name="ours_already")(h)
    return keras.Model(inputs, outputs)


class ConvertTest(parameterized.TestCase):
    def test_nested_model_keeps_config_weights_and_outputs(self):
        keras.utils.set_random_seed(0)
        model = _nested_model()
        x = np.random.RandomState(0).randn(8, 4, 4, 3).astype(np.float32) * 2 + 1
        _train_one_step(model, x, 5)
        before = model(x, training=False).numpy()
        converted = keras_bn.convert_batch_norm(model)
        self.assertEqual(_bn_classes(converted), [keras_bn.BatchNormalization] * 3)
        np.testing.assert_allclose(converted(x, training=False), before, rtol=1e-5, atol=1e-5)
        # The same parameters: the default keras_bn layer holds Keras' weights.
        self.assertEqual(converted.count_params(), model.count_params())
        # The original is untouched and shares no variable with the copy.
        self.assertEqual(_bn_classes(model)[:2], [keras.layers.BatchNormalization] * 2)
        np.testing.assert_array_equal(model(x, training=False), before)
        self.assertFalse({id(v) for v in model.weights} & {id(v) for v in converted.weights})
        self.assertEqual(converted.get_layer("conv_bn").epsilon, 1e-4)
        inner_bn = converted.get_layer("inner").get_layer("inner_bn")
        original_bn = model.get_layer("inner").get_layer("inner_bn")
        for name in ("moving_mean", "moving_variance"):
            np.testing.assert_array_equal(
                getattr(inner_bn, name), getattr(original_bn, name), err_msg=name
            )
        if not keras_features.KERAS_HAS_RENORM:
            self.skipTest(keras_features.NO_KERAS_RENORM)
        self.assertTrue(inner_bn.renorm)
        self.assertEqual(inner_bn.renorm_clipping, {"rmax": 2.0})
        for name in ("moving_stddev", "renorm_mean", "renorm_stddev"):
            np.testing.assert_array_equal(
                getattr(inner_bn, name), getattr(original_bn, name), err_msg=name
            )

    def test_synchronised_step_under_strategy(self):
        model = _nested_model()
        x = np.random.RandomState(3).randn(8, 4, 4, 3).astype(np.float32)
        _train_one_step(model, x, 5)
        _check_synchronised_step(self, model, x, 5)

    def test_bfloat16_model_keeps_keras_values_with_float32_statistics(self):
        keras.utils.set_random_seed(2)
        inputs = keras.Input((4, 4, 3))
        h = keras.layers.Conv2D(6, 3, use_bias=False, dtype="bfloat16")(inputs)
        h = keras.layers.BatchNormalization(momentum=0.5, dtype="bfloat16", name="bn")(h)
        model = keras.Model(inputs, h)
        x = np.random.RandomState(4).randn(8, 4, 4, 3).astype(np.float32) * 2 + 1
        model.compile(keras.optimizers.SGD(0.01), "mse")
        model.fit(x, np.zeros((8, 2, 2, 6), np.float32), batch_size=8, verbose=0)
        converted = keras_bn.convert_batch_norm(model)
        ours, theirs = converted.get_layer("bn"), model.get_layer("bn")
        self.assertIsInstance(ours, keras_bn.BatchNormalization)
        self.assertEqual(ours.dtype_policy.name, "bfloat16")
        self.assertEqual([w.dtype for w in ours.weights], ["bfloat16"] * 2 + ["float32"] * 2)
        for a, b in zip(ours.weights, theirs.weights):  # bfloat16 values, widened exactly.
            np.testing.assert_array_equal(
                np.asarray(keras.ops.convert_to_numpy(a), np.float32),
                np.asarray(keras.ops.convert_to_numpy(b), np.float32),
            )
        expected = np.asarray(keras.ops.convert_to_numpy(model(x, training=False)), np.float32)
        got = np.asarray(keras.ops.convert_to_numpy(converted(x, training=False)), np.float32)
        np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2)  # bfloat16 outputs.

    def test_overrides_apply_to_every_batch_norm(self):
        model = _nested_model()
        converted = keras_bn.convert_batch_norm(
            model, unbiased_variance=True, momentum=None, virtual_batch_size=4
        )
        for layer in population.batch_norm_layers(converted):
            self.assertTrue(layer.unbiased_variance)
            self.assertIsNone(layer.momentum)
            self.assertEqual(layer.virtual_batch_size, 4)

    @parameterized.named_parameters(
        (
            "not_a_model",
            keras.layers.Dense(2),
            {},
            TypeError,
            r"needs a Keras model. Received: model=Dense",
        ),
        (
            "unknown_override",
            None,
            {"num_groups": 4},
            TypeError,
            r"\['num_groups'\] are not keras_bn",
        ),
        ("bad_override_value", None, {"momentum": 2.0}, ValueError, r"Received: momentum=2.0"),
    )
    def test_rejects(self, model, overrides, error, pattern):
        model = _nested_model() if model is None else model
        with self.assertRaisesRegex(error, pattern):
            keras_bn.convert_batch_norm(model, **overrides)

    def test_rejects_subclassed_model(self):
        class Net(keras.Model):
            def __init__(self):
                super().__init__()
                self.bn = keras.layers.BatchNormalization()

            def call(self, x):
                return self.bn(x)

        net = Net()
        net(np.ones((2, 3), np.float32))
        with self.assertRaisesRegex(
            ValueError, r"subclassed model cannot be cloned.*Received: model=Net"
        ):
            keras_bn.convert_batch_norm(net)
        self.assertIsInstance(net.bn, keras.layers.BatchNormalization)


def _check_application(test, build):
    """A keras.applications model trained a step, converted: the same outputs and parameters.

    The synchronised step of a converted model under a strategy is
    ConvertTest.test_synchronised_step_under_strategy's (the nested model):
    a whole application's takes minutes on 2 CPU cores (MobileNetV2 164 s,
    ResNet50 over 20 minutes) and asserts nothing more.
    """
    keras.utils.set_random_seed(1)
    model = build()
    x = np.random.RandomState(1).rand(4, 32, 32, 3).astype(np.float32)
    _train_one_step(model, x, 10)
    first_bn = [x for x in model.layers if isinstance(x, keras.layers.BatchNormalization)][0]
    test.assertFalse(np.allclose(first_bn.moving_mean, 0.0))  # Not the initial statistics.
    expected = model(x, training=False).numpy()
    converted = keras_bn.convert_batch_norm(model)
    test.assertNotIn(keras.layers.BatchNormalization, _bn_classes(converted))
    np.testing.assert_allclose(
        converted(x, training=False), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max()
    )
    # The same parameters: the default keras_bn layer holds Keras' weights.
    test.assertEqual(converted.count_params(), model.count_params())


def _check_synchronised_step(test, model, x, classes):
    """Converted in a strategy's scope with synchronised moments: the copy's
    variables belong to the strategy and a training step runs."""
    strategy = sync_fixtures.mirrored_cpu_strategy(2)
    with strategy.scope():
        synced = keras_bn.convert_batch_norm(model, synchronized=True)
        synced.compile(
            keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    test.assertTrue(
        all(strategy.extended.variable_created_in_scope(v.value) for v in synced.weights)
    )
    test.assertTrue(all(layer.synchronized for layer in population.batch_norm_layers(synced)))
    history = synced.fit(x, np.arange(len(x)) % classes, batch_size=len(x), epochs=1, verbose=0)
    test.assertTrue(np.isfinite(history.history["loss"][0]))


@pytest.mark.slow
class ApplicationsTest(absltest.TestCase):
    """keras.applications models (minutes each on 2 CPU cores: slow suite)."""

    def test_mobilenet_v2(self):
        _check_application(
            self,
            lambda: keras.applications.MobileNetV2(
                input_shape=(32, 32, 3),
                alpha=0.35,
                weights=None,
                classes=10,
                classifier_activation=None,
            ),
        )

    def test_resnet50(self):
        _check_application(
            self,
            lambda: keras.applications.ResNet50(
                input_shape=(32, 32, 3), weights=None, classes=10, classifier_activation=None
            ),
        )


if __name__ == "__main__":
    absltest.main()
