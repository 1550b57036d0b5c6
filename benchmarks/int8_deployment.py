r"""Deploying a BN network in int8: train, fold, quantise, and each model's test accuracy.

Trains the MNIST trainer's BN network (`trainers/mnist/model.py`: three
sigmoid layers of 100 units, each Dense → keras_bn BN, the paper's §4.1) with
`fit` (SGD, the trainer's learning rate 0.5 and batch 60), then measures on
the real MNIST test set (10,000 images):

- the float model (BN with its moving statistics);
- `keras_bn.fold_batch_norm` of it (each BN folded into the Dense before it);
- Keras 3's own `model.quantize("int8")` of the folded model (int8 kernels,
  inputs quantised on the fly), on the engine of `KERAS_BACKEND`;
- TensorFlow Lite full-integer int8 (`TFLITE_BUILTINS_INT8`, calibrated on
  --calibration_examples training images) of the folded model and, for
  comparison, of the unfolded one (TensorFlow engine only).

Prints one table row per model: test accuracy, the largest logit difference
from the float model, and the size of its file (`.keras` or `.tflite`).

Run:
    python -m benchmarks.int8_deployment --data_dir=../shared/data/tensorflow_datasets
"""

import os
import tempfile

from absl import app
from absl import flags
import keras
import numpy as np

import keras_bn
from trainers.mnist import data as mnist_data
from trainers.mnist import model as mnist_model

_DATA_DIR = flags.DEFINE_string("data_dir", None, "TFDS data directory holding mnist.")
_EPOCHS = flags.DEFINE_integer(
    "epochs", 50, "Training epochs of 1,000 steps (50: Figure 1's 50,000).", lower_bound=1
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the kernels and the data order.", lower_bound=0)
_CALIBRATION = flags.DEFINE_integer(
    "calibration_examples", 1000, "Training images calibrating TFLite's int8.", lower_bound=1
)


def train(images, labels):
    """The trained BN network (logits out), as the MNIST trainer builds it."""
    keras.utils.set_random_seed(_SEED.value)
    model, _ = mnist_model.build_model("batch_norm", init_std=0.1, seed=_SEED.value)
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(images, labels, batch_size=60, epochs=_EPOCHS.value, verbose=2)
    return model


def keras_size(model):
    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    model.save(path)
    return os.path.getsize(path)


def tflite_int8(model, calibration):
    """The full-integer TFLite flatbuffer of `model` (float input and output)."""
    import tensorflow as tf

    saved = os.path.join(tempfile.mkdtemp(), "saved_model")
    model.export(saved, format="tf_saved_model", verbose=False)
    converter = tf.lite.TFLiteConverter.from_saved_model(saved)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = lambda: ([row[None]] for row in calibration)
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    return converter.convert()


def tflite_logits(flatbuffer, images):
    import tensorflow as tf

    interpreter = tf.lite.Interpreter(model_content=flatbuffer)
    (given,) = interpreter.get_input_details()
    interpreter.resize_tensor_input(given["index"], images.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(given["index"], images)
    interpreter.invoke()
    (out,) = interpreter.get_output_details()
    return interpreter.get_tensor(out["index"])


def main(argv):
    del argv
    images, labels = mnist_data.load_mnist(_DATA_DIR.value, "train")
    test_images, test_labels = mnist_data.load_mnist(_DATA_DIR.value, "test")
    model = train(images, labels)
    rows = []  # (model, logits, file size)
    float_logits = np.asarray(model.predict(test_images, batch_size=1000, verbose=0))
    rows.append(("float (BN, moving statistics)", float_logits, keras_size(model)))
    folded = keras_bn.fold_batch_norm(model)
    rows.append(("folded", folded.predict(test_images, 1000, 0), keras_size(folded)))
    quantized = keras_bn.fold_batch_norm(model)
    quantized.quantize("int8")
    rows.append(
        (
            'folded, Keras quantize("int8")',
            quantized.predict(test_images, 1000, 0),
            keras_size(quantized),
        )
    )
    if keras.backend.backend() == "tensorflow":
        calibration = images[: _CALIBRATION.value]
        for name, source in (("folded", folded), ("unfolded", model)):
            flatbuffer = tflite_int8(source, calibration)
            logits = tflite_logits(flatbuffer, test_images)
            rows.append((f"{name}, TFLite full-integer int8", logits, len(flatbuffer)))
    print(f"\nkeras {keras.__version__}, backend {keras.backend.backend()}")
    print("| model | test accuracy | max abs logit difference from float | file bytes |")
    print("|---|---|---|---|")
    for name, logits, size in rows:
        logits = np.asarray(logits, np.float64)
        accuracy = float(np.mean(np.argmax(logits, -1) == test_labels))
        difference = float(np.max(np.abs(logits - float_logits)))
        print(f"| {name} | {accuracy:.4f} | {difference:.2e} | {size or '—'} |")


if __name__ == "__main__":
    app.run(main)
