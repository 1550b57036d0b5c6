"""The conformance matrix: every path, dtype, layout and transform against float64.

Each cell runs one training call of `keras_bn.BatchNormalization` on the
current Keras backend under one transform, and compares with the float64
NumPy reference (`tests/training_reference.py`, no autodiff): the output,
∂L/∂x, ∂L/∂γ, ∂L/∂β, the Hessian-vector product ∂²L/∂x²·v (second-order
transforms), the forward-mode tangent ∂y/∂x·v (`jax.jvp`) and the moving
statistics, each as the largest error relative to the reference's largest
value. Where Keras' `BatchNormalization` supports the cell it runs the same
cell, and keras_bn's error must be at most the larger of Keras' error and the
dtype's tolerance. Cells a backend cannot run are refused by the layer with
a `ValueError`, which the cell checks; the matrix, refused cells included, is
printed at the end of the pytest run (`conftest.py`).

Three blocks keep it fast: every path × transform at float32 on NHWC maps;
every dtype policy × transform; every layout × transform. `.ci/run` runs it
per backend (JAX with `JAX_ENABLE_X64=1`, else float64 cells skip).
"""

import contextlib
import dataclasses
import math

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np

import keras_bn
from keras_bn import kernels
from tests import sync_fixtures
from tests import training_reference

BACKEND = keras.backend.backend()

# (shape, feature axis) per layout; batches of 8 split over the 2 or 4
# tf.distribute replicas and the 8 JAX devices, and into ghost batches of 2.
LAYOUTS = {
    "nhwc": ((8, 3, 3, 4), 3),
    "nc": ((16, 3), 1),
    "nchw": ((8, 4, 3, 3), 1),
    "3d": ((8, 5, 3), 2),
    "5d": ((8, 2, 3, 2, 3), 4),
    "ncdhw": ((8, 3, 2, 3, 2), 1),
}
RENORM_CLIPPING = {"rmax": 1.5, "rmin": 0.5, "dmax": 0.5}
PATHS = {
    "default": {},
    "fused": {"fused": True},
    "general": {"fused": False},
    "sync": {"synchronized": True},
    "groups": {"synchronized": True, "sync_group_size": 2},
    # The merged-moments kernel ops (TensorFlow), which the rule takes on large inputs only.
    "sync_fused": {"synchronized": True, "fused": True},
    "ghost": {"virtual_batch_size": 2},
    # Every 4 examples, whatever the replicas hold: groups of 2 (TF: 2 per replica) or 4 (JAX: 1).
    "sync_examples": {"synchronized": True, "virtual_batch_size": 4},
    "mask": {},
    "renorm": {"renorm": True, "renorm_clipping": RENORM_CLIPPING},
    "cumulative": {"momentum": None, "unbiased_variance": True},
    "warmup": {"momentum_warmup": True},
    "guard": {"count_skipped_updates": True},
    # Batch statistics in inference too: a training call is the default's.
    "batch_always": {"statistics": "batch"},
    # Frozen statistics: the moving ones normalise in training, and stay.
    "frozen": {"statistics": "moving"},
    # One update per 2 training calls (a single call moves nothing).
    "accumulate": {"accumulation_steps": 2},
}
# Paths Keras' layer has, with its arguments.
SYNC_PATHS = ("sync", "groups", "sync_fused", "sync_examples")
KERAS_PATHS = {"default": {}, "fused": {}, "general": {}, "sync": {}, "mask": {}}
TRANSFORMS = {
    "tensorflow": ("eager", "function", "xla", "grad2", "hvp", "fit"),
    "jax": ("eager", "jit", "vmap", "checkpoint", "grad2", "hvp", "jvp", "fit"),
    "torch": ("eager", "compile", "grad2", "fit"),
}[BACKEND]
SECOND_ORDER = ("grad2", "hvp")
DTYPES = ("float32", "mixed_float16", "mixed_bfloat16", "float64")
# Relative error allowed per policy: float32 arithmetic, a float16 or
# bfloat16 output (8 and 11 significant bits fewer), float64 arithmetic
# (the reference's differences are good to about 1e-11).
TOLERANCE = {"float32": 1e-4, "mixed_float16": 4e-3, "mixed_bfloat16": 3e-2, "float64": 1e-8}
# Replicas of the synchronised paths: tf.distribute logical CPUs (conftest.py
# splits 4) and the JAX host devices (8).
REPLICAS = 4 if BACKEND == "tensorflow" else 8

RESULTS = []  # One row per cell, printed by conftest.py.


@dataclasses.dataclass(frozen=True)
class Cell:
    path: str
    dtype: str
    layout: str
    transform: str

    @property
    def name(self):
        return f"{self.path}-{self.dtype}-{self.layout}-{self.transform}"


def _cells():
    # `fit` on (N, C) rows: its last batch of one is then one value per feature.
    cells = [
        Cell(p, "float32", "nc" if t == "fit" else "nhwc", t) for p in PATHS for t in TRANSFORMS
    ]
    # The kernel rule and fused=True per dtype and layout: fused kernels take
    # 16-bit inputs and channels-first maps where the engine has them.
    for path in ("default", "fused"):
        cells += [Cell(path, d, "nhwc", t) for d in DTYPES[1:] for t in TRANSFORMS]
        cells += [Cell(path, "float32", la, t) for la in list(LAYOUTS)[1:] for t in TRANSFORMS]
    return list({c.name: c for c in cells}.items())  # Blocks overlap at (N, C) fit.


def refusal(cell):
    """The `ValueError` message (a regex) with which the layer refuses a cell, or `None`."""
    if cell.path == "fused":
        compute = keras.DTypePolicy(cell.dtype).compute_dtype
        shape, axis = LAYOUTS[cell.layout]
        channels_first = axis == 1 and len(shape) in (4, 5)
        if BACKEND == "jax" or compute not in kernels.kernel_dtypes():
            return "fused=True needs a fused batch-norm kernel"
        if channels_first and BACKEND == "tensorflow" and not kernels.tensorflow_onednn_enabled():
            return "fused=True needs a fused batch-norm kernel, but TensorFlow's CPU kernel runs"
        if axis != len(shape) - 1 and not channels_first:
            return "fused=True needs a fused batch-norm kernel, but its features must be"
    if cell.path == "sync_fused" and BACKEND == "jax":
        return "fused=True needs a fused batch-norm kernel"
    if cell.path == "fused" and cell.transform == "xla":
        # XLA expands the op with Var = E[x²] − E[x]² (keras_bn/kernels.py).
        return "fused=True needs a fused batch-norm kernel, but under XLA"
    fit_ghost = cell.path == "ghost" or (cell.path == "sync_examples" and BACKEND != "jax")
    if fit_ghost and cell.transform == "fit":
        # The last batch of one does not tile into ghost batches (`fit` without a strategy).
        return "virtual_batch_size=[24] must divide|must divide each replica's batch"
    return None


def _refusal_errors():
    """A `ValueError`, or TensorFlow's run-time check of a batch known only then."""
    if BACKEND != "tensorflow":
        return ValueError
    import tensorflow as tf

    return (ValueError, tf.errors.InvalidArgumentError)


def not_run(cell):
    """Why a cell is outside what this matrix runs, or `None`."""
    if cell.path in SYNC_PATHS and BACKEND == "torch":
        # Replicas are processes there: keras_bn/torch_distributed_test.py launches them.
        return "torch.distributed's replicas are processes (torch_distributed_test.py)"
    if cell.dtype == "float64" and BACKEND == "jax":
        import jax

        if not jax.config.read("jax_enable_x64"):
            return "JAX runs float64 only with JAX_ENABLE_X64=1"
    if cell.path in SYNC_PATHS and BACKEND == "jax" and cell.transform == "fit":
        return "keras.distribution cannot shard a batch of one over 8 devices (nor a Dense model)"
    if cell.path == "groups" and cell.transform == "fit":
        return "a batch of one fills one replica group: the groups' copies differ"
    if cell.path == "renorm" and BACKEND == "torch" and cell.transform in ("compile", "fit"):
        # Measured with torch 2.13 (and before the derivative rule changed):
        # AOTAutograd saves renorm's statistics for the backward pass, which
        # their in-place update then changes.
        return "torch.compile: renorm's statistics are updated in place after being saved"
    if cell.path in SYNC_PATHS and BACKEND == "tensorflow":
        if cell.transform == "xla":
            # "Trying to access resource ... located in device CPU:1 from device CPU:0".
            return "TensorFlow 2.21 cannot XLA-compile MirroredStrategy on logical CPUs"
        if cell.transform == "hvp":
            # Measured: 2.7e-01 off for Keras' layer as for keras_bn.
            return "ForwardAccumulator gives zero tangents through tf.distribute's all_reduce"
    return None


class Case:
    """The data, reference and loss of one cell."""

    def __init__(self, cell, seed=0):
        self.cell = cell
        shape, axis = LAYOUTS[cell.layout]
        rng = np.random.RandomState(seed)
        self.x = (rng.randn(*shape) * 2.0 + 3.0).astype(np.float32)
        self.x2 = (rng.randn(*shape) * 0.5 - 1.0).astype(np.float32)
        self.v = rng.randn(*shape)
        self.w1, self.w2 = rng.randn(*shape), rng.randn(*shape)
        self.mask = None
        if cell.path == "mask":
            self.mask = (rng.rand(*shape[:-1]) > 0.3).astype("int32")
        self.axis = axis
        self.gamma = np.linspace(0.5, 1.5, shape[axis])
        self.beta = np.linspace(-0.5, 0.5, shape[axis])
        self.kwargs = dict(PATHS[cell.path], axis=axis, dtype=cell.dtype)
        # The frozen path's moving statistics, near the data's (mean 3, variance 4).
        self.moving = None
        if cell.path == "frozen":
            self.moving = (np.linspace(2.5, 3.5, shape[axis]), np.linspace(3.0, 5.0, shape[axis]))

    def reference(self, masked=True):
        """The float64 reference; `masked=False` for calls without the mask (fit)."""
        slices = 1
        if self.cell.path == "ghost":
            slices = self.x.shape[0] // 2
        elif self.cell.path == "groups":
            slices = REPLICAS // 2
        elif self.cell.path == "sync_examples":
            slices = self.x.shape[0] // 4
        weights = None
        if self.mask is not None and masked:
            weights = self.mask[..., None].astype(np.float64)
        setting = training_reference.Setting(
            feature_axes=(self.axis,),
            slices=slices,
            weights=weights,
            clipping=RENORM_CLIPPING if self.cell.path == "renorm" else None,
            statistics=self.moving,
        )
        return training_reference.Reference(setting, self.gamma, self.beta, self.w1, self.w2)

    def make_layer(self, keras_layer=False):
        if keras_layer:
            kwargs = dict(KERAS_PATHS[self.cell.path], axis=self.axis, dtype=self.cell.dtype)
            if self.cell.path == "sync" and BACKEND == "tensorflow":
                kwargs["synchronized"] = True
            cls = keras.layers.BatchNormalization
        else:
            kwargs, cls = self.kwargs, keras_bn.BatchNormalization
        dtype = "float64" if self.cell.dtype == "float64" else "float32"
        if self.moving is not None:
            mean, variance = (keras.initializers.Constant(v.astype(dtype)) for v in self.moving)
            kwargs = dict(
                kwargs, moving_mean_initializer=mean, moving_variance_initializer=variance
            )
        return cls(
            gamma_initializer=keras.initializers.Constant(self.gamma.astype(dtype)),
            beta_initializer=keras.initializers.Constant(self.beta.astype(dtype)),
            **kwargs,
        )


def _on_mesh(cell):
    """Whether a JAX cell runs under `DataParallel` (the synchronised paths)."""
    return cell.path in SYNC_PATHS


def expected(case):
    """The reference's values for the cell's transform."""
    cell, reference = case.cell, case.reference()
    x = case.x.astype(np.float64)
    rule = {
        "momentum": None if cell.path == "cumulative" else 0.99,
        "unbiased": cell.path == "cumulative",
        "warmup": cell.path == "warmup",
        "renorm": cell.path == "renorm",
        "accumulation_steps": 2 if cell.path == "accumulate" else None,
    }
    frozen = {}
    if case.moving is not None:  # Never moved.
        frozen = {"moving_mean": case.moving[0], "moving_variance": case.moving[1]}
    if cell.transform == "fit":
        if frozen:
            return frozen
        data = fit_data(case).astype(np.float64)
        batches = np.split(data, range(FIT_BATCH, len(data), FIT_BATCH))
        moments = [case.reference(masked=False).moments(b) for b in batches]
        mean, variance = training_reference.moving_statistics(moments, **rule)
        out = {"moving_mean": mean, "moving_variance": variance}
        if cell.path == "guard":  # The batches of one value per feature, counted.
            out["skipped_updates"] = float(sum(np.all(m[0] <= 1) for m in moments))
        return out
    out = {"y": reference.output(x)}
    if cell.transform == "jvp":
        out["tangent"] = reference.tangent(x, case.v)
        return out
    out["dx"], out["dgamma"], out["dbeta"] = reference.gradients(x)
    if cell.transform == "vmap":  # The second batch of the two mapped over.
        x2, other = case.x2.astype(np.float64), case.reference()  # Renorm's (r, d) are x2's.
        out["y_2"], out["dx_2"] = other.output(x2), other.gradients(x2)[0]
    if cell.transform in SECOND_ORDER:
        out["hvp"] = reference.hessian_vector(x, case.v)
    mean, variance = training_reference.moving_statistics([reference.moments(x)], **rule)
    out["moving_mean"], out["moving_variance"] = mean, variance
    return {**out, **frozen}


def relative_error(actual, reference):
    actual = np.asarray(actual, np.float64).reshape(np.shape(reference))
    scale = max(float(np.max(np.abs(reference))), 1e-12)
    return float(np.max(np.abs(actual - reference))) / scale


class ConformanceTest(parameterized.TestCase):
    @parameterized.named_parameters(_cells())
    def test_cell(self, cell):
        case = Case(cell)
        refused = refusal(cell)
        reason = None if refused else not_run(cell)
        if reason:
            RESULTS.append((cell, "not run", reason, None))
            self.skipTest(reason)
        if refused:
            with self.assertRaisesRegex(_refusal_errors(), refused):
                run_cell(case, keras_layer=False)
            RESULTS.append((cell, "refused", refused.split("|")[0], None))
            return
        want = expected(case)
        got = run_cell(case, keras_layer=False)
        errors = {k: relative_error(got[k], want[k]) for k in want}
        ours = max(errors.values())
        theirs = None
        if cell.path in KERAS_PATHS and cell.transform != "fit":
            try:
                their_values = run_cell(case, keras_layer=True)
                theirs = max(relative_error(their_values[k], want[k]) for k in want)
            except Exception as error:  # noqa: BLE001 - recorded in the matrix.
                theirs = f"{type(error).__name__}"
        # Keras' error is shown beside keras_bn's; the bound is the dtype's
        # tolerance alone (every cell Keras runs passes it for keras_bn).
        RESULTS.append((cell, "ok" if ours <= TOLERANCE[cell.dtype] else "FAIL", ours, theirs))
        worst = max(errors, key=errors.get)
        self.assertLessEqual(
            ours, TOLERANCE[cell.dtype], f"{cell.name}: {worst} off by {errors[worst]:.3g}"
        )


class Float64Test(parameterized.TestCase):
    """float64 layers exact to 1e-12: no float32 intermediate on any backend."""

    def setUp(self):
        super().setUp()
        reason = not_run(Cell("default", "float64", "nc", "eager"))
        if reason:
            self.skipTest(reason)

    @parameterized.named_parameters(
        (path, path) for path in ("default", "mask", "ghost", "renorm", "cumulative")
    )
    def test_training_call(self, path):
        # First derivatives and moving statistics (eager: no second derivative).
        case = Case(Cell(path, "float64", "nhwc", "eager"))
        case.x[...] = case.x + 100.0  # float32 sums would be off by about 1e-7 here.
        want, got = expected(case), run_cell(case, keras_layer=False)
        for key in want:
            self.assertLess(relative_error(got[key], want[key]), 1e-12, key)

    def test_population_estimate(self):
        rng = np.random.RandomState(3)
        batches = [rng.randn(n, 4) + 100.0 for n in (8, 8, 4)]
        model = keras.Sequential(
            [keras.Input((4,), dtype="float64"), keras_bn.BatchNormalization(dtype="float64")]
        )
        mean, variance = keras_bn.estimate_population_statistics(model, batches, num_batches=3)[
            model.layers[0].path
        ]
        counts = np.array([len(b) for b in batches], np.float64)
        want_mean = sum(c * b.mean(0) for c, b in zip(counts, batches)) / counts.sum()
        want_variance = sum(c * b.var(0) for c, b in zip(counts, batches)) / counts.sum()
        self.assertLess(relative_error(mean, want_mean), 1e-12)
        self.assertLess(relative_error(variance, want_variance), 1e-12)

    def test_folding(self):
        rng = np.random.RandomState(4)
        model = keras.Sequential(
            [
                keras.Input((5,), dtype="float64"),
                keras.layers.Dense(3, dtype="float64"),
                keras_bn.BatchNormalization(dtype="float64"),
            ]
        )
        bn = model.layers[1]
        bn.moving_mean.assign(rng.randn(3) + 50.0)
        bn.moving_variance.assign(rng.rand(3) * 1e-3 + 1e-4)
        bn.gamma.assign(rng.randn(3))
        dense = model.layers[0]
        scale = keras.ops.convert_to_numpy(bn.gamma) / np.sqrt(
            keras.ops.convert_to_numpy(bn.moving_variance) + bn.epsilon
        )
        kernel = keras.ops.convert_to_numpy(dense.kernel) * scale
        bias = (
            keras.ops.convert_to_numpy(dense.bias) - keras.ops.convert_to_numpy(bn.moving_mean)
        ) * scale + keras.ops.convert_to_numpy(bn.beta)
        folded = keras_bn.fold_batch_norm(model).layers[0]
        # The folded weights; the folded model's outputs then are those of
        # Keras' float64 Dense (whose PyTorch matmul was 3e-7 off NumPy).
        for got, want in ((folded.kernel, kernel), (folded.bias, bias)):
            got = keras.ops.convert_to_numpy(got)
            self.assertEqual(got.dtype, np.float64)
            self.assertLess(relative_error(got, want), 1e-12)


def run_cell(case, keras_layer):
    """The cell's values on this backend: dict of NumPy arrays, keys as `expected`."""
    if case.cell.transform == "fit":
        return _fit(case, keras_layer)
    return {"tensorflow": _tensorflow, "jax": _jax, "torch": _torch}[BACKEND](case, keras_layer)


def _statistics_dtype(cell):
    return "float64" if cell.dtype == "float64" else "float32"


FIT_BATCH = 8


def fit_data(case):
    """Both batches of the cell and one example more: `fit`'s last batch holds one."""
    return np.concatenate([case.x, case.x2, case.x[:1]])


def _fit(case, keras_layer):
    """`fit` in batches of 8 whose last holds one example."""
    x = fit_data(case)
    scope = contextlib.nullcontext()
    if case.cell.path in ("sync", "sync_fused") and BACKEND == "tensorflow":
        scope = sync_fixtures.mirrored_cpu_strategy(REPLICAS).scope()
    with scope:
        layer = case.make_layer(keras_layer)
        model = keras.Sequential([keras.Input(x.shape[1:]), layer])
        # A zero learning rate: the moving statistics then depend on x alone.
        # PyTorch compiles, as `jit_compile=True` users do (dynamic last batch).
        jit = True if BACKEND == "torch" else "auto"
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", jit_compile=jit)
    history = model.fit(
        x, np.zeros_like(x), batch_size=FIT_BATCH, epochs=1, shuffle=False, verbose=0
    )
    assert all(math.isfinite(v) for v in history.history["loss"]), history.history
    values = _moving(layer)
    if case.cell.path == "guard":
        values["skipped_updates"] = keras.ops.convert_to_numpy(layer.skipped_updates)
    return values


def _moving(layer, values=None):
    names = {v.name: i for i, v in enumerate(layer.non_trainable_variables)}
    if values is None:
        values = layer.non_trainable_variables
    return {
        name: keras.ops.convert_to_numpy(values[names[name]])
        for name in ("moving_mean", "moving_variance")
    }


def _loss(y, w1, w2, dtype):
    """L = Σ w₁ y + ½ Σ (w₂ y)² in the statistics' dtype."""
    ops = keras.ops
    y = ops.cast(y, dtype)
    w1, w2 = ops.convert_to_tensor(w1, dtype), ops.convert_to_tensor(w2, dtype)
    return ops.sum(w1 * y) + 0.5 * ops.sum(ops.square(w2 * y))


def _tensorflow(case, keras_layer):
    import tensorflow as tf

    cell = case.cell
    dtype = _statistics_dtype(cell)
    strategy = None
    if cell.path in SYNC_PATHS:
        strategy = sync_fixtures.mirrored_cpu_strategy(REPLICAS)
    with strategy.scope() if strategy else contextlib.nullcontext():
        layer = case.make_layer(keras_layer)
        rows = case.x.shape[0] // (strategy.num_replicas_in_sync if strategy else 1)
        layer.build((rows, *case.x.shape[1:]))
    mask = None if case.mask is None else tf.constant(case.mask)
    second = cell.transform in SECOND_ORDER

    def step(x, v, w1, w2):
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                y = layer(x, training=True, mask=mask)
                loss = _loss(y, w1, w2, dtype)
            dx, dgamma, dbeta = inner.gradient(loss, [x, layer.gamma, layer.beta])
            product = tf.reduce_sum(dx * v)
        hvp = outer.gradient(product, x) if second else tf.zeros_like(x)
        return y, dx, dgamma, dbeta, hvp

    def forward_over_reverse(x, v, w1, w2):
        with tf.autodiff.ForwardAccumulator(x, v) as accumulator:
            y, dx, dgamma, dbeta, _ = step(x, v, w1, w2)
        return y, dx, dgamma, dbeta, accumulator.jvp(dx)

    run = forward_over_reverse if cell.transform == "hvp" else step
    arrays = [a.astype(dtype) for a in (case.x, case.v, case.w1, case.w2)]
    if strategy is not None:
        parts = [_per_replica(strategy, a) for a in arrays]
        distributed = lambda *args: strategy.run(run, args=args)
        if cell.transform != "eager":
            distributed = tf.function(distributed)
        outputs = distributed(*parts)
        local = [strategy.experimental_local_results(o) for o in outputs]
        y, dx, hvp = (tf.concat(r, 0) for r in (local[0], local[1], local[4]))
        dgamma, dbeta = (tf.add_n(list(r)) for r in (local[2], local[3]))
    else:
        if cell.transform in ("function", "grad2", "hvp"):
            run = tf.function(run)
        elif cell.transform == "xla":
            run = tf.function(run, jit_compile=True)
        y, dx, dgamma, dbeta, hvp = run(*[tf.constant(a) for a in arrays])
    out = {"y": y, "dx": dx, "dgamma": dgamma, "dbeta": dbeta, "hvp": hvp}
    out = {k: np.asarray(tf.cast(t, tf.float64)) for k, t in out.items()}
    return {**out, **_moving(layer)}


def _per_replica(strategy, array):
    """`array` split over the strategy's replicas along the batch axis."""
    import tensorflow as tf

    parts = np.split(array, strategy.num_replicas_in_sync)
    return strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(parts[context.replica_id_in_sync_group])
    )


def _jax(case, keras_layer):
    import jax
    import jax.numpy as jnp

    cell = case.cell
    dtype = _statistics_dtype(cell)
    distribution = None
    if _on_mesh(cell):
        distribution = keras.distribution.DataParallel(devices=jax.devices()[:REPLICAS])
    scope = distribution.scope() if distribution else contextlib.nullcontext()
    with scope:
        layer = case.make_layer(keras_layer)
        layer.build(case.x.shape)
        trainable = [v.value for v in layer.trainable_variables]
        state = [v.value for v in layer.non_trainable_variables]
        mask = None if case.mask is None else jnp.asarray(case.mask)

        def forward(x, trainable):
            return layer.stateless_call(trainable, state, x, training=True, mask=mask)

        def loss(x, trainable):
            y, new_state = forward(x, trainable)
            return _loss(y, case.w1, case.w2, dtype), (y, new_state)

        def first(x):
            (dx, (dgamma, dbeta)), (y, new_state) = jax.grad(loss, (0, 1), has_aux=True)(
                x, trainable
            )
            return y, dx, dgamma, dbeta, new_state

        x, v = jnp.asarray(case.x, dtype), jnp.asarray(case.v, dtype)
        if cell.transform == "jvp":
            y, tangent = jax.jvp(lambda x: forward(x, trainable)[0], (x,), (v,))
            return {"y": np.asarray(y, np.float64), "tangent": np.asarray(tangent, np.float64)}
        hvp, second_batch = None, {}
        if cell.transform == "eager":
            with jax.disable_jit():
                y, dx, dgamma, dbeta, new_state = first(x)
        elif cell.transform == "jit":
            y, dx, dgamma, dbeta, new_state = jax.jit(first)(x)
        elif cell.transform == "checkpoint":
            checkpointed = jax.checkpoint(loss)
            (dx, (dgamma, dbeta)), (y, new_state) = jax.jit(
                jax.grad(checkpointed, (0, 1), has_aux=True)
            )(x, trainable)
        elif cell.transform == "vmap":
            xs = jnp.stack([x, jnp.asarray(case.x2, dtype)])
            y, dx, dgamma, dbeta, new_state = jax.jit(jax.vmap(first))(xs)
            second_batch = {"y_2": y[1], "dx_2": dx[1]}
            y, dx, dgamma, dbeta = y[0], dx[0], dgamma[0], dbeta[0]
            new_state = [s[0] for s in new_state]
        else:
            y, dx, dgamma, dbeta, new_state = jax.jit(first)(x)
            grad_x = lambda x: first(x)[1]
            if cell.transform == "grad2":
                hvp = jax.jit(jax.grad(lambda x: jnp.sum(grad_x(x) * v)))(x)
            else:
                hvp = jax.jit(lambda x: jax.jvp(grad_x, (x,), (v,))[1])(x)
    out = {"y": y, "dx": dx, "dgamma": dgamma, "dbeta": dbeta, **second_batch}
    if hvp is not None:
        out["hvp"] = hvp
    out = {k: np.asarray(t, np.float64) for k, t in out.items()}
    return {**out, **_moving(layer, new_state)}


def _torch(case, keras_layer):
    import torch

    cell = case.cell
    dtype = _statistics_dtype(cell)
    layer = case.make_layer(keras_layer)
    layer.build(case.x.shape)
    mask = None if case.mask is None else torch.as_tensor(case.mask)
    x = torch.tensor(case.x.astype(dtype), requires_grad=True)
    v = torch.tensor(case.v.astype(dtype))

    def loss_fn(x):
        y = layer(x, training=True, mask=mask)
        return _loss(y, case.w1, case.w2, dtype), y

    if cell.transform == "compile":
        loss_fn = torch.compile(loss_fn)
    loss, y = loss_fn(x)
    second = cell.transform in SECOND_ORDER
    dx, dgamma, dbeta = torch.autograd.grad(
        loss, [x, layer.gamma.value, layer.beta.value], create_graph=second
    )
    out = {"y": y, "dx": dx, "dgamma": dgamma, "dbeta": dbeta}
    if second:
        (out["hvp"],) = torch.autograd.grad((dx * v).sum(), x)
    out = {k: t.detach().to(torch.float64).numpy() for k, t in out.items()}
    return {**out, **_moving(layer)}


if __name__ == "__main__":
    absltest.main()
