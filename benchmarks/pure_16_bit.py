r"""Pure 16-bit policies: what keeping the moving statistics in float32 costs and buys.

Under `dtype="bfloat16"` (or `"float16"`) Keras' layer keeps γ, β and its
moving statistics in 16 bits; keras_bn keeps γ and β in 16 bits and its
moving statistics in float32. On the engine of `KERAS_BACKEND` this prints:

- the stall: each layer's moving mean after `--steps` training steps (one
  `fit`, learning rate 0) on one batch of `--batch` rows whose features have
  mean `--mean` and standard deviation 0.1, momentum 0.99, beside the exact
  average mean·(1 − 0.99^steps);
- the memory: the bytes of every batch-norm weight of ResNet-50 built under
  the policy (`keras.applications.ResNet50`, 64×64 inputs), with Keras'
  layers and converted to keras_bn (`convert_batch_norm`), beside the whole
  model's weights.

Step times under the pure policies are `benchmarks.kernel_speed
--policies=bfloat16`'s.

Run:
    python -m benchmarks.pure_16_bit
    KERAS_BACKEND=jax python -m benchmarks.pure_16_bit --policy=float16
"""

from absl import app
from absl import flags
import numpy as np

_POLICY = flags.DEFINE_enum("policy", "bfloat16", ["bfloat16", "float16"], "The pure policy.")
_STEPS = flags.DEFINE_integer("steps", 1000, "Training steps on the batch.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch", 32, "Rows of the batch.", lower_bound=2)
_MEAN = flags.DEFINE_float("mean", 1.0, "The features' mean.")


def batch_norm_bytes(model):
    """Bytes of the weights of every batch-norm layer of `model`, and of all its weights."""
    import keras

    import keras_bn

    classes = (keras.layers.BatchNormalization, keras_bn.BatchNormalization)
    bn = [w for layer in model.layers if isinstance(layer, classes) for w in layer.weights]

    def size(weights):
        return sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize for w in weights)

    return size(bn), size(model.weights), len(bn)


def main(argv):
    del argv
    import keras

    import keras_bn
    from tests import moving_averages

    policy = _POLICY.value
    rng = np.random.RandomState(0)
    x = (rng.randn(_BATCH.value, 4) * 0.1 + _MEAN.value).astype(np.float32)
    exact = np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(x, policy)), np.float64).mean(0)
    exact = exact * (1.0 - 0.99**_STEPS.value)
    print(
        f"backend {keras.backend.backend()}, Keras {keras.__version__}, policy {policy}, "
        f"momentum 0.99, {_STEPS.value} steps on one batch of {_BATCH.value}×4"
    )
    print("moving mean per feature:")
    for name, cls in (
        ("keras.layers.BatchNormalization", keras.layers.BatchNormalization),
        ("keras_bn.BatchNormalization", keras_bn.BatchNormalization),
    ):
        got = moving_averages.moving_mean_after(cls(momentum=0.99, dtype=policy), x, _STEPS.value)
        print(f"{name:<34}{np.array2string(got, precision=4)}")
    print(f"{'exact average':<34}{np.array2string(exact, precision=4)}")

    keras.config.set_dtype_policy(policy)
    try:
        model = keras.applications.ResNet50(input_shape=(64, 64, 3), weights=None, classes=10)
        ours = keras_bn.convert_batch_norm(model)
    finally:
        keras.config.set_dtype_policy("float32")
    print(f"\nResNet-50 under {policy}: batch-norm weights / all weights")
    for name, m in (("Keras' layer", model), ("keras_bn", ours)):
        bn, total, count = batch_norm_bytes(m)
        print(f"{name:<14}{bn / 2**10:>9.1f} KiB in {count} weights / {total / 2**20:.2f} MiB")


if __name__ == "__main__":
    app.run(main)
