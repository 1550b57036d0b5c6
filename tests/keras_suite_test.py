"""Keras' own BatchNormalization test suite, run against keras_bn's layer.

The test module shipped in the installed `keras` wheel
(`keras/src/layers/normalization/batch_normalization_test.py`) is imported at
test time, and every test of its `BatchNormalizationTest` runs with the
module's `layers.BatchNormalization` resolving to
`keras_bn.BatchNormalization` itself, in its default configuration (the
non-finite guard on); every other `layers.X` stays Keras'. Nothing of Keras'
test code is copied here. No test is excluded. CI runs it on every backend.
"""

import importlib
import types

import pytest

import keras_bn

try:
    keras_suite = importlib.import_module("keras.src.layers.normalization.batch_normalization_test")
except ImportError as error:  # A Keras build without its tests.
    pytest.skip(
        f"the installed keras ships no batch_normalization_test: {error}", allow_module_level=True
    )


class _LayersWithOurs(types.ModuleType):
    """Keras' `layers` module with `BatchNormalization` replaced by ours."""

    def __init__(self, layers):
        super().__init__(layers.__name__)
        self._layers = layers

    BatchNormalization = keras_bn.BatchNormalization

    def __getattr__(self, name):
        return getattr(self._layers, name)


class KerasSuiteTest(keras_suite.BatchNormalizationTest):
    def setUp(self):
        super().setUp()
        original = keras_suite.layers
        keras_suite.layers = _LayersWithOurs(original)
        self.addCleanup(setattr, keras_suite, "layers", original)

    def test_substitution_is_in_effect(self):
        self.assertIs(keras_suite.layers.BatchNormalization, keras_bn.BatchNormalization)
        self.assertTrue(keras_bn.BatchNormalization().skip_nonfinite_updates)
