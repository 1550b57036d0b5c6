r"""Where a keras_bn training call's time goes on PyTorch, above ATen's kernel.

Six Keras layers, timed round-robin in one process (paired rounds,
`benchmarks/timing.py`), each adding one part of keras_bn's training call to
the one before:

    keras layer floor      ATen's batch norm, running statistics moved in its
                           kernel, in the thinnest Keras layer
                           (`benchmarks/keras_floor.py`);
    batch-norm signature   the same ATen call in a keras_bn layer: its
                           weights, input spec and `mask` argument, which
                           Keras' `Layer.__call__` checks on every call;
    kernel                 keras_bn's kernel (chosen once by
                           `kernels.choose`): ATen's batch norm writing the
                           batch moments into two fresh zero buffers, and
                           the multiply that turns its Bessel-corrected
                           variance into σ²_B; no moving-statistics update;
    + update               and the update rule outside ATen's kernel
                           (`moving_statistics.assign`), without the
                           non-finite guard;
    + guard                and with the guard (the layer's default rule);
    keras_bn               the layer itself: the same operations, and the
                           Python that chooses them on every call (plan,
                           kernel, rule).

A training step is the forward pass in training mode and the gradients of
Σ w·y with respect to x, γ and β, as in `benchmarks.kernel_speed`. The table
gives each candidate's median time with its quartiles, its ratio to the
floor (median and quartiles of the per-round ratios), and the median
difference to the candidate above it. ATen's kernel, which moves its running
statistics itself in the floor, cannot skip a non-finite batch, and it moves
the running variance with the Bessel-corrected m/(m−1)·σ²_B: the rows from
"kernel" to "+ guard" are what keeping keras_bn's guard and biased-variance
default costs once the statistics are updated outside it.

Run:
    python -m benchmarks.torch_call_cost
    python -m benchmarks.torch_call_cost --shapes=256x100,32x14x14x256 --rounds=21
"""

import dataclasses
import os

from absl import app
from absl import flags
import numpy as np

from benchmarks import keras_floor
from benchmarks import timing

_SHAPES = flags.DEFINE_list(
    "shapes", ["256x100", "32x14x14x256"], "Input shapes (NHWC or NC), as AxBxC."
)
flags.register_validator(
    "shapes",
    lambda shapes: all(s.count("x") in (1, 3) for s in shapes),
    "Each shape is NC (AxB) or NHWC (AxBxCxD).",
)
_ROUNDS = flags.DEFINE_integer("rounds", 15, "Paired rounds.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 200, "Steps per timed sample.", lower_bound=1)

MOMENTUM, EPSILON = 0.99, 1e-3


def candidates(shape):
    """The six training steps at `shape` (channels last), by name, in the table's order."""
    import torch

    import keras_bn
    from keras_bn import kernels
    from keras_bn import moving_statistics

    rng = np.random.RandomState(0)
    x = torch.tensor((rng.randn(*shape) * 2 + 1).astype(np.float32)).requires_grad_(True)
    w = torch.tensor(rng.randn(*shape).astype(np.float32))
    axes = tuple(range(len(shape) - 1))

    class AtenInLayer(keras_bn.BatchNormalization):
        def call(self, inputs, training=None, mask=None):
            view = inputs if len(shape) != 4 else inputs.permute(0, 3, 1, 2)
            y = torch.nn.functional.batch_norm(
                view,
                self.moving_mean.value,
                self.moving_variance.value,
                self.gamma.value,
                self.beta.value,
                training=True,
                momentum=1.0 - self.momentum,
                eps=self.epsilon,
            )
            return y if view is inputs else y.permute(0, 2, 3, 1)

    # The layer's kernel for this input, chosen once (the layer chooses on every call).
    kernel = kernels.choose(x, axes, EPSILON, fused=None, training=True)

    class KernelThen(keras_bn.BatchNormalization):
        """keras_bn's kernel, then `rule` (or no update for `None`)."""

        def __init__(self, rule, **kwargs):
            super().__init__(**kwargs)
            self.rule = rule

        def call(self, inputs, training=None, mask=None):
            y, (count, mean, variance) = kernel.train(
                inputs, self.gamma.value, self.beta.value, self.epsilon
            )
            if self.rule is not None:
                variables = {"moving_mean": self.moving_mean}
                variables["moving_variance"] = self.moving_variance
                moving_statistics.assign(self.rule, variables, mean, variance, count)
            return y

    guarded = moving_statistics.Rule(
        momentum=MOMENTUM, unbiased_variance=False, epsilon=EPSILON, skip_nonfinite=True
    )
    native = (torch.nn.BatchNorm1d if len(shape) == 2 else torch.nn.BatchNorm2d)(
        shape[-1], eps=EPSILON, momentum=1.0 - MOMENTUM
    )
    kwargs = {"momentum": MOMENTUM, "epsilon": EPSILON}
    layers = {
        "keras layer floor": keras_floor.keras_wrapped(native, channels_first=False),
        "batch-norm signature": AtenInLayer(**kwargs),
        "kernel": KernelThen(None, **kwargs),
        "+ update": KernelThen(dataclasses.replace(guarded, skip_nonfinite=False), **kwargs),
        "+ guard": KernelThen(guarded, **kwargs),
        "keras_bn": keras_bn.BatchNormalization(**kwargs),
    }

    def step(layer):
        layer.build(shape)

        def run():
            x.grad = None
            (layer(x, training=True) * w).sum().backward()

        return run

    return {name: step(layer) for name, layer in layers.items()}


def main(argv):
    del argv
    import keras
    import torch

    threads = torch.get_num_threads()
    print(f"Keras {keras.__version__}, torch {torch.__version__}, {threads} threads")
    print("training step, µs: median [q1–q3]; ratio to the floor [q1–q3]; µs over the row above")
    for text in _SHAPES.value:
        shape = tuple(int(d) for d in text.split("x"))
        samples = timing.time_rounds(candidates(shape), 20, _REPEATS.value, _ROUNDS.value)
        samples = {name: np.asarray(s) * 1e6 for name, s in samples.items()}
        floor = samples["keras layer floor"]
        previous = None
        for name, values in samples.items():
            q1, median, q3 = np.percentile(values, [25, 50, 75])
            r1, ratio, r3 = np.percentile(values / floor, [25, 50, 75])
            step = "" if previous is None else f"{median - np.median(previous):+8.1f}"
            print(
                f"{text:<15}{name:<22}{median:9.1f} [{q1:.1f}–{q3:.1f}]"
                f"{ratio:7.2f} [{r1:.2f}–{r3:.2f}]{step}"
            )
            previous = values


if __name__ == "__main__":
    os.environ["KERAS_BACKEND"] = "torch"  # Before Keras is imported (in `main`).
    app.run(main)
