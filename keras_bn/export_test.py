"""keras_bn models through `model.export` on each route of each backend, plain and folded.

A small conv network with keras_bn layers (moving statistics away from their
initial values) is exported with Keras' `model.export(format=...)`, loaded by
the route's own runtime, and its output compared with `model.predict`; so is
the network with its batch norms folded (`keras_bn.fold_batch_norm`). The
routes and the packages each needs:

- TensorFlow: `tf_saved_model` (TensorFlow), `onnx` (tf2onnx, onnxruntime),
  `litert` (ai-edge-litert), `openvino` (OpenVINO);
- JAX: `tf_saved_model` (TensorFlow);
- PyTorch: `onnx` (onnxscript, onnxruntime), `openvino` (OpenVINO).

A route whose packages are not installed is skipped, saying which; CI
installs them (`.ci/run`). docs/layer.md names the routes not tested.
"""

import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np

import keras_bn

BACKEND = keras.backend.backend()
_TOLERANCE = 1e-5
_ROUTES = {
    "tensorflow": ("tf_saved_model", "onnx", "litert", "openvino"),
    "jax": ("tf_saved_model",),
    "torch": ("onnx", "openvino"),
}
_PACKAGES = {
    "tf_saved_model": ("tensorflow",),
    "onnx": ("onnxruntime", "onnx")
    + (("tf2onnx",) if BACKEND == "tensorflow" else ("onnxscript",)),
    "litert": ("ai_edge_litert",),
    "openvino": ("openvino",),
}


def _model():
    """A conv network whose keras_bn layers have moving statistics of their own."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.Conv2D(4, 3, use_bias=False),
            keras_bn.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.Flatten(),
            keras.layers.Dense(5, use_bias=False),
            keras_bn.BatchNormalization(momentum=None, unbiased_variance=True),
        ]
    )
    rng = np.random.default_rng(0)
    for _ in range(3):  # Training-mode passes move the statistics.
        model(rng.normal(2.0, 3.0, (16, 8, 8, 3)).astype("float32"), training=True)
    return model


def _run_export(route, path, x):
    """The exported model at `path`, run by `route`'s runtime on `x`."""
    if route == "tf_saved_model":
        import tensorflow as tf

        loaded = tf.saved_model.load(path)  # Kept: its functions read its variables.
        return np.asarray(loaded.serve(tf.constant(x)))
    if route == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        return session.run(None, {session.get_inputs()[0].name: x})[0]
    if route == "litert":
        from ai_edge_litert import interpreter as litert

        runner = litert.Interpreter(model_path=path)
        runner.resize_tensor_input(runner.get_input_details()[0]["index"], x.shape)
        runner.allocate_tensors()
        runner.set_tensor(runner.get_input_details()[0]["index"], x)
        runner.invoke()
        return runner.get_tensor(runner.get_output_details()[0]["index"])
    import openvino

    # OpenVINO computes in bfloat16 by default on CPUs that have it.
    config = {"INFERENCE_PRECISION_HINT": "f32"}
    compiled = openvino.Core().compile_model(path, "CPU", config)
    return next(iter(compiled(x).values()))


def _file(route, directory):
    names = {"onnx": "model.onnx", "litert": "model.tflite", "openvino": "model.xml"}
    return os.path.join(directory, names[route]) if route in names else directory


class ExportTest(parameterized.TestCase):
    @parameterized.parameters(
        (route, folded) for route in sorted(set().union(*_ROUTES.values())) for folded in (0, 1)
    )
    def test_the_export_equals_predict(self, route, folded):
        if route not in _ROUTES.get(BACKEND, ()):
            self.skipTest(f"{route} is not a route tested on {BACKEND} (docs/layer.md)")
        for package in _PACKAGES[route]:
            try:
                __import__(package)
            except ImportError:
                self.skipTest(f"{route} needs {package}, not installed here")
        model = _model()
        if folded:
            model = keras_bn.fold_batch_norm(model)
            self.assertFalse(
                [layer for layer in model.layers if isinstance(layer, keras_bn.BatchNormalization)]
            )
        x = np.random.default_rng(1).normal(2.0, 3.0, (4, 8, 8, 3)).astype("float32")
        want = model.predict(x, verbose=0)
        path = _file(route, tempfile.mkdtemp())
        model.export(path, format=route, verbose=False)
        got = _run_export(route, path, x)
        np.testing.assert_allclose(got, want, rtol=_TOLERANCE, atol=_TOLERANCE)


if __name__ == "__main__":
    absltest.main()
