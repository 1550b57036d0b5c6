r"""keras_bn against the batch-norm kernels users already have, on every engine.

Each engine runs in its own process (`--engine`); without it, the script
runs TensorFlow, PyTorch and JAX in turn and prints one table per mode. A
*training* step is the forward pass in training mode, the gradients of
Σ w·y with respect to x, γ and β, and the moving-statistics update; an
*inference* step is the forward pass with the moving statistics. Every
candidate of an engine is timed round-robin in the same process (paired
rounds: each round times every candidate once, `--repeats` steps each); the
tables give each candidate's median ms with its quartiles, and its ratio to
the engine's fastest peer kernel as the median (and quartiles) of the
per-round ratios.

Candidates:
    TensorFlow  keras_bn (its rule), keras_bn fused=False (the general
                path), Keras' layer, raw `tf.nn.fused_batch_norm` (with a
                moving-average update of its outputs, as a layer does);
                each a `tf.function` of the whole step (`--jit_compile`:
                compiled by XLA, where keras_bn takes its general path).
    PyTorch     keras_bn and Keras' layer under KERAS_BACKEND=torch,
                `torch.nn.BatchNorm1d/2d` (2d on channels_last tensors),
                and that module called inside the thinnest Keras layer
                ("keras layer floor": the least any Keras layer costs on
                this backend, eager, as Keras runs torch).
    JAX         keras_bn and Keras' layer, each one jitted
                `stateless_call` + gradient program.

The bandwidth bound is the time to move the step's minimal traffic at this
machine's measured copy bandwidth (`numpy.copyto` of a 256 MB float32
array: one read and one write per element). The pass model counts full
tensor passes of the input's size: training 8 (moments read x; normalise
reads x, writes y; backward sums read x and dy; dx reads x, dy, writes
dx), inference 2 (read x, write y).

Dtype policies (`--policies`) give the input in the policy's compute dtype
(the raw kernels take it with float32 statistics; under the pure 16-bit
policies the layers' γ and β are 16-bit); `--layouts=channels_first`
runs each 4-D shape (given NHWC) as NCHW with `axis=1`.

Run:
    python -m benchmarks.kernel_speed                 # every engine, default shapes
    python -m benchmarks.kernel_speed --engines=torch --shapes=64x28x28x64
    python -m benchmarks.kernel_speed --policies=mixed_bfloat16 --layouts=channels_first
    python -m benchmarks.kernel_speed --engines=tensorflow --jit_compile
"""

import json
import time

from absl import app
from absl import flags
import numpy as np

from benchmarks import keras_floor
from benchmarks import timing

_ENGINE = flags.DEFINE_enum(
    "engine", None, ["tensorflow", "torch", "jax"], "One engine in this process (a worker)."
)
_ENGINES = flags.DEFINE_multi_enum(
    "engines", ["tensorflow", "torch", "jax"], ["tensorflow", "torch", "jax"], "Engines to run."
)
_SHAPES = flags.DEFINE_list(
    "shapes",
    ["256x100", "64x28x28x64", "32x14x14x256", "128x56x56x64"],
    "Input shapes (NHWC or NC), as AxBxC.",
)
_ROUNDS = flags.DEFINE_integer("rounds", 9, "Paired rounds.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Steps per timed sample.", lower_bound=1)
_MODES = flags.DEFINE_list("modes", ["training", "inference"], "training and/or inference.")
_POLICIES = flags.DEFINE_multi_enum(
    "policies",
    ["float32"],
    ["float32", "mixed_bfloat16", "mixed_float16", "bfloat16", "float16"],
    "Keras dtype policies: the input in its compute dtype, statistics in float32 (under the "
    "pure 16-bit ones, Keras' layer keeps its statistics in 16 bits, keras_bn in float32).",
)
_LAYOUTS = flags.DEFINE_multi_enum(
    "layouts",
    ["channels_last"],
    ["channels_last", "channels_first"],
    "Where the features are: last, or second (4-D shapes only, given NHWC and run as NCHW).",
)
_JIT_COMPILE = flags.DEFINE_bool(
    "jit_compile",
    False,
    "TensorFlow: compile every candidate's step with XLA (`tf.function(jit_compile=True)`, "
    "which Keras' `compile` picks by default on GPUs).",
)

TRAINING_PASSES, INFERENCE_PASSES = 8, 2


def copy_bandwidth():
    """Bytes/s of `numpy.copyto` over 256 MB (read + write), best of 5."""
    src = np.ones(64 * 2**20, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def _arrays(shape):
    rng = np.random.RandomState(0)
    return (rng.randn(*shape) * 2 + 1).astype(np.float32), rng.randn(*shape).astype(np.float32)


def _compute_dtype(policy):
    return {"mixed_bfloat16": "bfloat16", "mixed_float16": "float16"}.get(policy, policy)


def _layer_kwargs(policy, layout):
    return {"dtype": policy, "axis": 1 if layout == "channels_first" else -1}


def tensorflow_steps(shape, mode, policy, layout):
    import keras
    import tensorflow as tf

    import keras_bn

    x_np, w_np = _arrays(shape)
    dtype = _compute_dtype(policy)
    x, w = tf.constant(x_np, dtype=dtype), tf.constant(w_np, dtype=dtype)
    first = layout == "channels_first"
    channels = shape[1] if first else shape[-1]
    data_format = "NCHW" if first else "NHWC"
    kwargs = _layer_kwargs(policy, layout)
    compiled = tf.function(jit_compile=_JIT_COMPILE.value)

    def layer_step(layer):
        layer.build(shape)
        if mode == "inference":
            return compiled(lambda: layer(x, training=False))

        @compiled
        def step():
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(tf.cast(layer(x, training=True), dtype) * w)
            return tape.gradient(loss, [x, layer.gamma, layer.beta])

        return step

    gamma, beta = tf.Variable(tf.ones(channels)), tf.Variable(tf.zeros(channels))
    moving_mean, moving_variance = tf.Variable(tf.zeros(channels)), tf.Variable(tf.ones(channels))
    x4 = tf.reshape(x, (-1, 1, 1, channels)) if len(shape) != 4 else x
    w4 = tf.reshape(w, x4.shape)
    fused_kwargs = {"epsilon": 1e-3, "data_format": data_format}

    @compiled
    def raw_training():
        with tf.GradientTape() as tape:
            tape.watch(x4)
            y, mean, variance = tf.compat.v1.nn.fused_batch_norm(
                x4, gamma, beta, is_training=True, **fused_kwargs
            )
            loss = tf.reduce_sum(y * w4)
        grads = tape.gradient(loss, [x4, gamma, beta])
        moving_mean.assign(moving_mean * 0.99 + mean * 0.01)
        moving_variance.assign(moving_variance * 0.99 + variance * 0.01)
        return grads

    @compiled
    def raw_inference():
        return tf.compat.v1.nn.fused_batch_norm(
            x4, gamma, beta, moving_mean, moving_variance, is_training=False, **fused_kwargs
        )[0]

    steps = {
        "keras_bn": layer_step(keras_bn.BatchNormalization(**kwargs)),
        "keras_bn general": layer_step(keras_bn.BatchNormalization(fused=False, **kwargs)),
        "keras": layer_step(keras.layers.BatchNormalization(**kwargs)),
        "tf.nn.fused_batch_norm": raw_training if mode == "training" else raw_inference,
    }
    blocking = {name: (lambda fn=fn: _block_tf(fn())) for name, fn in steps.items()}
    return blocking, ["tf.nn.fused_batch_norm"]


def _block_tf(result):
    import tensorflow as tf

    for t in tf.nest.flatten(result):
        t.numpy()


def torch_steps(shape, mode, policy, layout):
    import keras
    import torch

    import keras_bn

    x_np, w_np = _arrays(shape)
    dtype = getattr(torch, _compute_dtype(policy))
    first = layout == "channels_first"
    channels = shape[1] if first else shape[-1]
    kwargs = _layer_kwargs(policy, layout)
    keras_x = torch.tensor(x_np).to(dtype).requires_grad_(mode == "training")
    keras_w = torch.tensor(w_np).to(dtype)

    def layer_step(layer):
        layer.build(shape)
        if mode == "inference":
            return lambda: layer(keras_x, training=False)

        def step():
            keras_x.grad = None
            (layer(keras_x, training=True) * keras_w).sum().backward()

        return step

    if len(shape) == 4 and not first:  # channels_last: the memory of the NHWC array.
        native = torch.nn.BatchNorm2d(channels, eps=1e-3, momentum=0.01)
        torch_x = torch.tensor(x_np).permute(0, 3, 1, 2)
        torch_w = torch.tensor(w_np).permute(0, 3, 1, 2)
        assert torch_x.is_contiguous(memory_format=torch.channels_last)
    elif first:  # Contiguous NCHW, ATen's own layout.
        native = torch.nn.BatchNorm2d(channels, eps=1e-3, momentum=0.01)
        torch_x, torch_w = torch.tensor(x_np), torch.tensor(w_np)
    else:
        native = torch.nn.BatchNorm1d(channels, eps=1e-3, momentum=0.01)
        torch_x, torch_w = torch.tensor(x_np), torch.tensor(w_np)
    torch_x = torch_x.to(dtype).requires_grad_(mode == "training")  # float32 parameters
    torch_w = torch_w.to(dtype)

    def native_step():
        if mode == "inference":
            native.eval()
            with torch.no_grad():
                return native(torch_x)
        native.train()
        torch_x.grad = None
        (native(torch_x) * torch_w).sum().backward()

    name = "torch BatchNorm2d" if len(shape) == 4 else "torch BatchNorm1d"
    steps = {
        "keras_bn": layer_step(keras_bn.BatchNormalization(**kwargs)),
        "keras_bn general": layer_step(keras_bn.BatchNormalization(fused=False, **kwargs)),
        "keras": layer_step(keras.layers.BatchNormalization(**kwargs)),
        "keras layer floor": layer_step(keras_floor.keras_wrapped(native, channels_first=first)),
        name: native_step,
    }
    if mode == "inference":
        steps = {k: (lambda fn=fn: _no_grad(fn)) for k, fn in steps.items()}
    return steps, [name]


def _no_grad(fn):
    import torch

    with torch.no_grad():
        return fn()


def jax_steps(shape, mode, policy, layout):
    import jax
    import keras

    import keras_bn
    from tests import jax_programs

    x_np, w_np = _arrays(shape)
    dtype = _compute_dtype(policy)
    x, w = jax.numpy.asarray(x_np, dtype), jax.numpy.asarray(w_np, dtype)
    kwargs = _layer_kwargs(policy, layout)

    def layer_step(layer):
        layer.build(shape)
        if mode == "inference":
            trainable = [v.value for v in layer.trainable_variables]
            non_trainable = [v.value for v in layer.non_trainable_variables]
            infer = jax.jit(lambda t, n, x: layer.stateless_call(t, n, x, training=False)[0])
            return lambda: infer(trainable, non_trainable, x).block_until_ready()
        step, trainable, non_trainable = jax_programs.make_jax_training_step(layer)
        return lambda: jax.block_until_ready(step(trainable, non_trainable, x, w))

    steps = {
        "keras_bn": layer_step(keras_bn.BatchNormalization(**kwargs)),
        "keras": layer_step(keras.layers.BatchNormalization(**kwargs)),
    }
    return steps, ["keras"]


ENGINE_STEPS = {"tensorflow": tensorflow_steps, "torch": torch_steps, "jax": jax_steps}


def run_engine(engine):
    """Times every candidate of `engine` at each shape and mode; one JSON line each."""
    bandwidth = copy_bandwidth()
    configs = [
        (mode, text, policy, layout)
        for mode in _MODES.value
        for policy in _POLICIES.value
        for layout in _LAYOUTS.value
        for text in _SHAPES.value
        if layout == "channels_last" or text.count("x") == 3
    ]
    for mode, text, policy, layout in configs:
        shape = tuple(int(d) for d in text.split("x"))
        if layout == "channels_first":
            shape = (shape[0], shape[3], shape[1], shape[2])
        steps, peers = ENGINE_STEPS[engine](shape, mode, policy, layout)
        samples = timing.time_rounds(steps, 3, _REPEATS.value, _ROUNDS.value)
        passes = TRAINING_PASSES if mode == "training" else INFERENCE_PASSES
        itemsize = 4 if policy == "float32" else 2
        bound = passes * np.prod(shape) * itemsize / bandwidth
        record = {"engine": engine, "mode": mode, "shape": text, "policy": policy}
        record.update(jit_compile=_JIT_COMPILE.value and engine == "tensorflow")
        record.update(layout=layout, peers=peers, bound_s=bound, bandwidth_GBs=bandwidth / 1e9)
        print(json.dumps({**record, "samples": samples}), flush=True)


def _quartiles(values):
    return np.percentile(values, [25, 50, 75])


def print_table(records):
    for mode in _MODES.value:
        print(f"\n{mode} step, ms: median [q1–q3]; ratio to the engine's fastest peer kernel")
        print(
            f"{'engine':<11}{'shape':<15}{'policy':<16}{'layout':<15}{'candidate':<24}"
            f"{'ms':>22}{'ratio':>20}{'of bound':>9}"
        )
        for record in (r for r in records if r["mode"] == mode):
            samples = {k: np.asarray(v) for k, v in record["samples"].items()}
            fastest = min(record["peers"], key=lambda p: np.median(samples[p]))
            for name, values in samples.items():
                q1, median, q3 = _quartiles(values) * 1e3
                r1, ratio, r3 = _quartiles(values / samples[fastest])
                print(
                    f"{record['engine']:<11}{record['shape']:<15}{record['policy']:<16}"
                    f"{record['layout']:<15}{name:<24}"
                    f"{median:9.3f} [{q1:.3f}–{q3:.3f}]  {ratio:6.2f} [{r1:.2f}–{r3:.2f}]"
                    f"{record['bound_s'] * 1e3 / median * 100:8.0f}%"
                )
        print(f"bandwidth bound at {records[0]['bandwidth_GBs']:.1f} GB/s (numpy.copyto)")


def main(argv):
    del argv
    if _ENGINE.value:
        run_engine(_ENGINE.value)
        return
    records = timing.records_per_engine("benchmarks.kernel_speed", _ENGINES.value)
    print_table(records)


if __name__ == "__main__":
    app.run(main)
