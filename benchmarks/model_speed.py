r"""Whole-model training steps with Keras' batch norm and with keras_bn, on every engine.

A model from `keras.applications` (`weights=None`) is built once with Keras'
`BatchNormalization` and converted with `keras_bn.convert_batch_norm` (same
weights and configuration); both are compiled with SGD and a sparse
cross-entropy loss, and one `train_on_batch` step of each is timed
round-robin in the same process (paired rounds, `benchmarks/timing.py`).
Each engine runs in its own process. The table gives each candidate's median
step time with its quartiles, and keras_bn's time over Keras' as the median
(and quartiles) of the per-round ratios: below 1 is faster than Keras'
layer. With `--floor` (default) a third candidate, the same model with every
batch norm replaced by an identity, gives the step time that no batch norm
can beat: its ratio to Keras' bounds keras_bn's from below. On PyTorch a
fourth, every batch norm ATen's in the thinnest Keras layer
(`benchmarks/keras_floor.py`), gives the least a Keras batch-norm layer
costs there.

`--models=mnist` is the paper's MNIST network instead (784-100-100-100-10,
sigmoid, Keras' batch norm after each hidden layer; inputs of 784 features).
"BN cost ratio" is keras_bn's batch-norm cost over Keras' layer's, each
over the no-batch-norm model: (keras_bn − no-BN) / (Keras − no-BN), of the
medians; "floor cost ratio" the same for the Keras-layer floor.

Run:
    python -m benchmarks.model_speed                       # ResNet-50, every engine, f32 + bf16
    python -m benchmarks.model_speed --models=mnist --batch=60 --policies=float32 --rounds=21 \
        --repeats=20
    python -m benchmarks.model_speed --models=mobilenetv2 --engines=jax --policies=float32
    python -m benchmarks.model_speed --data_formats=channels_first --engines=torch
"""

import json

from absl import app
from absl import flags
import numpy as np

from benchmarks import keras_floor
from benchmarks import timing

_ENGINE = flags.DEFINE_enum(
    "engine", None, ["tensorflow", "torch", "jax"], "One engine in this process (a worker)."
)
_ENGINES = flags.DEFINE_multi_enum(
    "engines", ["tensorflow", "jax", "torch"], ["tensorflow", "torch", "jax"], "Engines to run."
)
_MODELS = flags.DEFINE_multi_enum(
    "models",
    ["resnet50"],
    ["resnet50", "mobilenetv2", "mnist"],
    "keras.applications models, or the paper's MNIST network.",
)
_POLICIES = flags.DEFINE_multi_enum(
    "policies",
    ["float32", "mixed_bfloat16"],
    ["float32", "mixed_bfloat16", "mixed_float16"],
    "Keras dtype policies.",
)
_DATA_FORMATS = flags.DEFINE_multi_enum(
    "data_formats",
    ["channels_last"],
    ["channels_last", "channels_first"],
    "Image data formats (channels_first needs an engine whose CPU convolutions take NCHW).",
)
_BATCH = flags.DEFINE_integer("batch", 32, "Examples per step.", lower_bound=2)
_SIZE = flags.DEFINE_integer("size", 64, "Image height and width.", lower_bound=32)
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Paired rounds.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 2, "Steps per timed sample.", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps of each (compilation).", lower_bound=1)
_FLOOR = flags.DEFINE_bool(
    "floor",
    True,
    "Also time the model with every batch norm replaced by an identity: the step time no batch "
    "norm can beat, so (floor / Keras) bounds keras_bn / Keras from below.",
)

_APPLICATIONS = {"resnet50": "ResNet50", "mobilenetv2": "MobileNetV2"}
KERAS_FLOOR = "keras layer floor"


def _replace_batch_norm(model, replacement):
    """A copy of `model` whose batch norms are `replacement(layer)`, other layers fresh copies."""
    import keras

    def clone(layer):
        if isinstance(layer, keras.layers.BatchNormalization):
            return replacement(layer)
        return layer.__class__.from_config(layer.get_config())

    return keras.models.clone_model(model, clone_function=clone)


def without_batch_norm(model):
    """A copy of `model` whose batch norms are identities (the floor candidate)."""
    import keras

    class NoBatchNorm(keras.layers.Layer):
        def call(self, inputs, training=None, mask=None):  # BN's call signature.
            return inputs

    return _replace_batch_norm(model, lambda layer: NoBatchNorm(name=layer.name))


def with_keras_layer_floor(model):
    """A copy of `model` (PyTorch) whose batch norms are the Keras-layer floor.

    ATen's batch norm in the thinnest Keras layer (`benchmarks.keras_floor`):
    the least a Keras batch-norm layer can cost per call.
    """
    import torch

    def floor(layer):
        rank = len(layer.input.shape)
        axis = layer.axis if isinstance(layer.axis, int) else layer.axis[0]
        kind = torch.nn.BatchNorm1d if rank == 2 else torch.nn.BatchNorm2d
        module = kind(layer.input.shape[axis], eps=layer.epsilon, momentum=1.0 - layer.momentum)
        return keras_floor.keras_wrapped(module, channels_first=rank == 4 and axis % rank == 1)

    return _replace_batch_norm(model, floor)


def mnist_network():
    """The paper's MNIST network: 784-100-100-100-10, sigmoid, Keras' batch norm in each layer."""
    import keras

    inputs = keras.Input((784,))
    h = inputs
    for _ in range(3):
        h = keras.layers.Dense(100, use_bias=False)(h)
        h = keras.layers.Activation("sigmoid")(keras.layers.BatchNormalization()(h))
    return keras.Model(inputs, keras.layers.Dense(10)(h))


def candidate_builders():
    """Each candidate's name and the function making it from a model with Keras' batch norm."""
    import keras_bn

    return {
        "keras": lambda model: model,
        "keras_bn": keras_bn.convert_batch_norm,
        "no batch norm": without_batch_norm,
        KERAS_FLOOR: with_keras_layer_floor,  # PyTorch only.
    }


def candidates(model_name, policy, data_format):
    """`{"keras": step, "keras_bn": step[, "no batch norm": step, "keras layer floor": step]}`:
    one `train_on_batch` each on the same batch (the floor on PyTorch only)."""
    import keras

    keras.config.set_dtype_policy(policy)
    keras.config.set_image_data_format(data_format)
    size = _SIZE.value
    shape = (size, size, 3) if data_format == "channels_last" else (3, size, size)
    keras.utils.set_random_seed(0)
    if model_name == "mnist":
        shape = (784,)
        model = mnist_network()
    else:
        model = getattr(keras.applications, _APPLICATIONS[model_name])(
            weights=None, input_shape=shape, classes=10
        )
    rng = np.random.RandomState(0)
    x = rng.rand(_BATCH.value, *shape).astype(np.float32)
    y = rng.randint(0, 10, _BATCH.value)
    names = ["keras", "keras_bn"]
    if _FLOOR.value:
        names.append("no batch norm")
        if keras.backend.backend() == "torch":
            names.append(KERAS_FLOOR)
    builders = candidate_builders()
    steps = {}
    for name in names:
        candidate = builders[name](model)
        candidate.compile(
            optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy"
        )
        steps[name] = lambda candidate=candidate: candidate.train_on_batch(x, y)
    return steps


def run_engine(engine):
    """Times the candidates of every configuration; one JSON line each."""
    for model_name in _MODELS.value:
        for policy in _POLICIES.value:
            for data_format in _DATA_FORMATS.value:
                steps = candidates(model_name, policy, data_format)
                samples = timing.time_rounds(steps, _WARMUP.value, _REPEATS.value, _ROUNDS.value)
                record = {"engine": engine, "model": model_name, "policy": policy}
                record.update(data_format=data_format, samples=samples)
                print(json.dumps(record), flush=True)


def print_table(records):
    print(
        f"batch {_BATCH.value}, {_SIZE.value}x{_SIZE.value} images (mnist: 784 features); "
        "step ms: median [q1–q3]; "
        "keras_bn / Keras per round: median [q1–q3]"
    )
    print(
        f"{'engine':<11}{'model':<13}{'policy':<16}{'format':<15}"
        f"{'keras ms':>26}{'keras_bn ms':>26}{'ratio':>20}"
        f"{'no-BN ms':>26}{'no-BN / keras':>20}{'BN cost ratio':>15}"
        f"{'Keras-layer floor ms':>26}{'floor cost ratio':>18}"
    )
    for record in records:
        samples = {k: np.asarray(v) for k, v in record["samples"].items()}
        names = [n for n in ("keras", "keras_bn", "no batch norm", KERAS_FLOOR) if n in samples]
        cells = {}
        for name in names:
            q1, median, q3 = np.percentile(samples[name], [25, 50, 75]) * 1e3
            r1, ratio, r3 = np.percentile(samples[name] / samples["keras"], [25, 50, 75])
            cells[name] = (
                f"{median:9.1f} [{q1:.1f}–{q3:.1f}]",
                f"{ratio:9.3f} [{r1:.3f}–{r3:.3f}]",
            )
        floor = cells.get("no batch norm", ("", ""))
        medians = {name: np.median(samples[name]) for name in names}
        cost = {name: "" for name in ("keras_bn", KERAS_FLOOR)}
        if "no batch norm" in samples:
            # A candidate's batch-norm cost over Keras' layer's, each above no batch norm.
            none_ms = medians["no batch norm"]
            for name in cost:
                if name in medians:
                    ratio = (medians[name] - none_ms) / (medians["keras"] - none_ms)
                    cost[name] = f"{ratio:.2f}"
        print(
            f"{record['engine']:<11}{record['model']:<13}{record['policy']:<16}"
            f"{record['data_format']:<15}{cells['keras'][0]:>26}{cells['keras_bn'][0]:>26}"
            f"{cells['keras_bn'][1]:>20}{floor[0]:>26}{floor[1]:>20}{cost['keras_bn']:>15}"
            f"{cells.get(KERAS_FLOOR, ('',))[0]:>26}{cost[KERAS_FLOOR]:>18}"
        )


def main(argv):
    del argv
    if _ENGINE.value:
        run_engine(_ENGINE.value)
        return
    records = timing.records_per_engine("benchmarks.model_speed", _ENGINES.value)
    print_table(records)


if __name__ == "__main__":
    app.run(main)
