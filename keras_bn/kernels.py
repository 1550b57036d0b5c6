"""Which kernel normalises a call: the engine's fused batch norm, or the general path.

`choose` is the one decision. The general path (`keras_bn.normalize`, plain
`keras.ops`) runs every case on every backend. Where an engine ships a fused
batch-norm kernel with the same meaning, and measurements showed it faster
there (docs/benchmarks.md), a call that kernel can express runs through it:

- TensorFlow: `FusedBatchNormV3` (`tf.compat.v1.nn.fused_batch_norm`), in
  training and inference, on GPU, and on CPU for inputs of at least 2^16
  values when TensorFlow's oneDNN kernels are on, or the input is 16-bit;
- PyTorch: `torch.nn.functional.batch_norm` (ATen's native kernel), in
  training and inference, on every device;
- JAX: none; XLA fuses the general path.

A call can use a fused kernel when its input's dtype is one the engine's
kernel takes with float32 statistics (`kernel_dtypes`: float32, and the
16-bit dtypes of mixed precision where measured faster, the input then
going to the kernel without a cast), it has one feature axis, the last (a
2-D `(N, C)` input included) or the second of a 4-D or 5-D map
(channels-first: NCHW, and NCDHW viewed as NCHW), ε is at least 1.001e-5
(the least TensorFlow's kernel accepts; it would raise a smaller one) and,
in training, it has no mask, no Batch Renormalization, no ghost batches or
`keras.distribution` slices and no cross-replica merge. Everything else,
float64 included, takes the general path, which casts a 16-bit input to
float32. So does TensorFlow's training
under XLA (`jit_compile=True`, TPUs): XLA lowers the op to BatchNormTraining,
which its CPU and GPU backends expand with Var = E[x²] − E[x]², losing the
float32 variance where |mean|/std is large (the general path compiles to
two passes). And TensorFlow's inference under op determinism, where the
fused op's gradient is not implemented on GPU.

Both kernels normalise with the biased batch variance and return the
Bessel-corrected m/(m−1)·σ²_B (TensorFlow as its batch variance, PyTorch in
the running variance it writes with momentum 1); the kernel here undoes the
correction, so the moving-statistics update rule sees the same biased σ²_B as
on the general path and applies `unbiased_variance` itself.

A static training batch of one value per feature (m = 1) takes the general
path whatever `fused` says, `fused=True` included: its output is β either
way (γ·d + β with renorm, which has no kernel), and PyTorch's kernel raises
on it.

TensorFlow's oneDNN kernels are on by default only on some CPUs (and off with
`TF_ENABLE_ONEDNN_OPTS=0`); without them its float32 CPU fused kernel was no
faster than the general path at some shapes and slower at others, so the
rule keeps the general path there for float32 (its 16-bit kernels were
faster, and run). `fused=False` on the layer forces the general path
everywhere; `fused=True` asks for the fused kernel and raises where this
engine and call cannot use one.
"""

import functools
import math
import os

import keras
from keras import ops

# TensorFlow's kernel refuses a smaller epsilon (cuDNN's least).
MIN_FUSED_EPSILON = 1.001e-5


def choose(x, reduction_axes, epsilon, *, fused, training, plain=True, statistics="float32"):
    """The fused kernel for a call, or `None` for the general path.

    Args:
        x: the call's input in its own float dtype (a kernel may take a
            16-bit input with float32 statistics; the general path casts it
            to the statistics' dtype first).
        reduction_axes: the axes its statistics reduce (sorted, non-negative).
        epsilon: the layer's ε.
        fused: the layer's `fused` argument: `None` (the measured rule),
            `True` (required) or `False` (never).
        training: whether the call normalises with batch statistics.
        plain: whether the call has none of what only the general path
            expresses (mask, renorm, slices, cross-replica merge); always
            true for inference.
        statistics: the layer's statistics dtype; the kernels keep theirs
            (γ, β, moving statistics) in float32.

    Returns:
        A kernel with `train(x, gamma, beta, epsilon)` (per-feature float32
        tensors, γ and β possibly `None`; returns `(y, (count, mean,
        variance))`, `y` in `x`'s dtype, the biased variance in float32,
        `count` a Python int when `x`'s shape is static) and `infer(x, mean,
        variance, gamma, beta, epsilon)` (per-feature variables or tensors,
        γ and β possibly `None`), or `None`.

    Raises:
        ValueError: with `fused=True` when no fused kernel can run the call.
    """
    layout = _layout(x, reduction_axes)
    if fused is False or (training and _single_value(x, reduction_axes)):
        # One value per feature in training: y = β on the general path, the
        # kernels' meaning too (PyTorch's raises on it, even for fused=True).
        return None
    reason = _unsupported(x, layout, epsilon, plain, training)
    if reason is None and statistics != "float32":
        reason = f"its statistics are float32, not {statistics}"
    if reason is None and fused is None and not _faster_here(x, layout, training):
        reason = "the measured rule keeps the general path on this platform"
    if reason is None:
        return _KERNELS[keras.backend.backend(), layout == CHANNELS_FIRST]
    return _refuse(reason, fused)


def _refuse(reason, fused):
    """`None` (the general path), or the `ValueError` that `fused=True` asked for."""
    if fused:
        raise ValueError(
            f"fused=True needs a fused batch-norm kernel, but {reason}. Pass fused=None to "
            "choose automatically. Received: fused=True"
        )
    return None


def choose_for_merged_moments(x, reduction_axes, epsilon, *, fused):
    """The kernel that normalises a call with moments merged across replicas, or `None`.

    A synchronised call cannot run the fused training op, whose statistics
    are its own replica's. On TensorFlow a float32 channels-last call still
    takes two of its ops: the inference op normalises with the merged
    moments (one pass instead of two), and the inference form of its
    gradient op gives dy·γr and this replica's sums Σ dy, Σ dy·x̂ in one pass
    (instead of five) before they are all-reduced. The measured rule takes
    them where the fused kernel is the faster path (GPU; a oneDNN CPU and at
    least 2^16 values): a training step of `benchmarks/sync_speed.py`'s
    synchronised model took 0.99× Keras' `synchronized=True` with them and
    1.04× without (oneDNN on); without oneDNN they were no faster (0.96×
    either way). `fused=True` takes them wherever they can run.

    Args:
        x: the call's float input, already in the statistics' dtype.
        reduction_axes: the axes its statistics reduce.
        epsilon: the layer's ε.
        fused: the layer's `fused`: `None` (the measured rule), `True`
            (required) or `False` (never).

    Returns:
        A kernel with `normalize_given(x, gamma, beta, mean, variance,
        epsilon)` and `local_gradient(dy, x, gamma, mean, variance,
        epsilon)` (per-feature float32 tensors), or `None`.

    Raises:
        ValueError: with `fused=True` when the call cannot run them.
    """
    if fused is False:
        return None
    layout = _layout(x, reduction_axes)
    dtype = keras.backend.standardize_dtype(x.dtype)
    reason = None
    if keras.backend.backend() != "tensorflow":
        reason = "its merged-moments ops are TensorFlow's"
    elif dtype != "float32":
        reason = f"with merged moments its ops take float32 statistics, not {dtype}"
    elif layout != CHANNELS_LAST:
        reason = "with merged moments its features must be the last axis"
    elif epsilon < MIN_FUSED_EPSILON:
        reason = f"epsilon={epsilon} is below its least {MIN_FUSED_EPSILON}"
    elif _in_xla_context():
        reason = "under XLA, which fuses the general path, its ops are not used"
    elif _op_determinism_enabled():
        reason = "under op determinism its gradient op is not implemented on GPU"
    elif fused is None and not _faster_here(x, layout, training=True):
        reason = "the measured rule keeps the general path on this platform"
    if reason is None:
        return _TensorFlowKernel(channels_first=False)
    return _refuse(reason, fused)


CHANNELS_LAST, CHANNELS_FIRST = "channels_last", "channels_first"


def _layout(x, reduction_axes):
    """Where a call's one feature axis is: last (rank ≥ 2), second of a 4-D/5-D map, or `None`."""
    rank = len(x.shape)
    if rank >= 2 and tuple(reduction_axes) == tuple(range(rank - 1)):
        return CHANNELS_LAST
    if rank in (4, 5) and tuple(reduction_axes) == (0, *range(2, rank)):
        return CHANNELS_FIRST
    return None


def _single_value(x, reduction_axes):
    """Whether `x` holds a single value per feature (static shapes only)."""
    reduced = [x.shape[a] for a in reduction_axes]
    return None not in reduced and math.prod(reduced) == 1


def kernel_dtypes():
    """The input dtypes this engine's kernel takes where the rule measured it faster.

    TensorFlow's CPU kernel runs bfloat16 and float16 inputs with float32
    statistics faster than the general path's casts to float32 (with
    oneDNN, channels-last: 3.9 vs 13.3 ms and 9.3 vs 12.8 ms for a training
    step at (64, 28, 28, 64); `_faster_here` holds the exceptions); on GPU,
    cuDNN's float16 (not measured here). PyTorch's native kernel:
    `TORCH_KERNEL_DTYPES`.
    """
    backend = keras.backend.backend()
    if backend == "torch":
        return TORCH_KERNEL_DTYPES
    if backend != "tensorflow":
        return ()
    if _tensorflow_has_gpu():
        return ("float32", "float16")
    return ("float32", "bfloat16", "float16")


# PyTorch's kernel takes 16-bit inputs with float32 statistics (ATen's
# mixed-type batch norm): a training step at (32, 14, 14, 256) took 2.0 ms in
# bfloat16 and 1.9 ms in float16, against 10.2 and 11.7 ms through the
# general path's float32 casts (docs/benchmarks.md).
TORCH_KERNEL_DTYPES = ("float32", "bfloat16", "float16")


def _unsupported(x, layout, epsilon, plain, training):
    """Why no fused kernel can run this call (with the general path's meaning), or `None`."""
    backend = keras.backend.backend()
    if (backend, False) not in _KERNELS:
        return f"the {backend} backend has none (XLA fuses the general path)"
    if not plain:
        return "masks, renorm, ghost batches, slices and synchronised moments need the general path"
    dtype = keras.backend.standardize_dtype(x.dtype)
    if dtype not in kernel_dtypes():
        return f"its kernel here takes {', '.join(kernel_dtypes())} inputs, not {dtype}"
    if layout is None:
        return (
            "its features must be one axis, the last of an input of rank 2 or more or the "
            "second of a 4-D or 5-D input"
        )
    if layout == CHANNELS_FIRST and backend == "tensorflow" and not _channels_first_here():
        return "TensorFlow's CPU kernel runs channels-first inputs only with oneDNN"
    if 0 in x.shape:
        return "the batch is empty"
    if epsilon < MIN_FUSED_EPSILON:
        return f"epsilon={epsilon} is below its least {MIN_FUSED_EPSILON}"
    if backend == "tensorflow":
        return _tensorflow_unsupported(training)
    return None


def _channels_first_here():
    """Whether TensorFlow's fused kernel takes NCHW here: on GPU, and on CPU with oneDNN."""
    return _tensorflow_has_gpu() or tensorflow_onednn_enabled()


def _tensorflow_unsupported(training):
    """Where TensorFlow's op would not mean what the general path means."""
    if training and _in_xla_context():
        # XLA lowers the op to BatchNormTraining, which its CPU and GPU
        # backends expand with Var = E[x²] − E[x]²: at |mean|/std = 1e4 the
        # float32 variance came out 0 to 72 instead of 1.
        return "under XLA its training op takes the variance as E[x²] − E[x]²"
    if not training and _op_determinism_enabled():
        return "under op determinism its inference op has no gradient on GPU"
    return None


def _op_determinism_enabled():
    """`tf.config.experimental.enable_op_determinism()`'s state (Keras reads it the same way)."""
    try:
        from tensorflow.python.framework import config  # No public query.

        return bool(config.is_op_determinism_enabled())
    except (ImportError, AttributeError):
        return os.environ.get("TF_DETERMINISTIC_OPS", "").lower() in ("1", "true")


def _in_xla_context():
    """Whether TensorFlow is tracing for XLA (`jit_compile=True`, TPUs).

    TensorFlow has no public query; its own check (which tf-keras' fused
    batch norm used) is read where present, else XLA is assumed.
    """
    try:
        import tensorflow as tf
        from tensorflow.python.ops import control_flow_util  # No public name.

        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
    except (ImportError, AttributeError):
        return True


# TensorFlow's oneDNN CPU kernel has a fixed cost that the general path beats
# on small inputs: (256, 100) took 0.68 ms fused vs 0.41 ms in training,
# (8, 14, 14, 64) 0.65 vs 0.76 ms, (1024, 256) 0.99 vs 0.93 (docs/benchmarks.md).
MIN_ONEDNN_FUSED_SIZE = 2**16


def _faster_here(x, layout, training):
    """The measured rule: whether this engine's fused kernel is the faster path here.

    On oneDNN CPUs TensorFlow's channels-first kernel was faster than the
    general path in training (14.5 vs 28.8 ms at (64, 64, 28, 28)) but slower
    in inference (4.8 vs 2.9 ms), and in float16 no faster in training
    (12.6 vs 10.4 ms at (32, 256, 14, 14)); channels-last it was faster in
    every dtype. Without oneDNN its float32 kernel was no faster than the
    general path, its 16-bit ones were (8.7 vs 11.9 ms in bfloat16, 8.8 vs
    12.9 ms in float16 at (64, 28, 28, 64)) (docs/benchmarks.md).
    """
    if keras.backend.backend() != "tensorflow":
        return True
    if _tensorflow_has_gpu():
        return True
    dtype = keras.backend.standardize_dtype(x.dtype)
    if not tensorflow_onednn_enabled() and dtype == "float32":
        return False
    if layout == CHANNELS_FIRST and (not training or dtype == "float16"):
        return False
    known = [d for d in x.shape if d is not None]
    # A batch size known only at run time counts as large (training batches).
    return len(known) < len(x.shape) or math.prod(known) >= MIN_ONEDNN_FUSED_SIZE


@functools.cache
def _tensorflow_has_gpu():
    """Whether TensorFlow sees a GPU: fixed once its runtime is up, which listing starts."""
    import tensorflow as tf

    return bool(tf.config.list_logical_devices("GPU"))


@functools.cache
def tensorflow_onednn_enabled():
    """Whether TensorFlow runs its oneDNN CPU kernels in this process.

    TensorFlow turns them on when `TF_ENABLE_ONEDNN_OPTS` says so, and when
    it is unset on Linux x86 CPUs with AVX-512 VNNI or BF16, AVX-VNNI or AMX
    (its start-up log line "oneDNN custom operations are on" says the same).
    TensorFlow has no public query; its own check is used where present.
    """
    try:
        from tensorflow.python.util import _pywrap_util_port  # The only exact source.

        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        setting = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "")
        return setting.lower() in ("1", "true")


def _channels_last(x):
    """A torch `x` in a layout ATen takes with its features second, and the inverse view.

    A 2-D `(N, C)` input goes as it is (`BatchNorm1d`'s layout). An NHWC
    input is viewed as its (N, C, H, W) permutation, which ATen runs with
    its channels-last kernels; any other rank as `(M, C, 1, 1)` rows of C,
    which ATen takes for contiguous NCHW (both views of the same memory).
    On the 2-core benchmark machine a training step took 6.8 ms through the
    NHWC permutation at (64, 28, 28, 64) and 8.0 ms through the rows, and at
    (256, 100) 129 µs as `(N, C)` against 167 µs through the rows.
    """
    if len(x.shape) == 2:
        return x, lambda y: y
    if len(x.shape) == 4:
        return x.permute(0, 3, 1, 2), lambda y: y.permute(0, 2, 3, 1)
    shape = x.shape
    view = x.reshape(-1, 1, 1, shape[-1]).permute(0, 3, 1, 2)
    return view, lambda y: y.permute(0, 2, 3, 1).reshape(shape)


def _value(value):
    """A Keras variable's backend tensor (what `ops.convert_to_tensor` returns, without
    its dispatch cost in eager calls); tensors and `None` pass through."""
    return value.value if isinstance(value, keras.Variable) else value


def _unbias(variance, count):
    """σ²_B from a kernel's m/(m−1)·σ²_B (a static m = 1 takes the general path).

    `count` is a Python number when the shape is static (one multiply), else
    a tensor.
    """
    if isinstance(count, (int, float)):
        return variance * ((count - 1.0) / max(count, 1.0))
    return variance * ((count - 1.0) / ops.maximum(count, 1.0))


def _vector(value, default, channels):
    """A per-feature float32 value as a tensor (`default` everywhere for `None`)."""
    if value is None:
        return ops.full((channels,), default, dtype="float32")
    return _value(value)


def _count(x, channel_axis):
    """The values per feature: a Python int when `x`'s shape is static, else a float32 tensor."""
    reduced = [i for i in range(len(x.shape)) if i != channel_axis % len(x.shape)]
    dims = [x.shape[i] for i in reduced]
    if None not in dims:
        # A list, not a generator: `torch.compile` cannot trace `math.prod` over a
        # generator, and its graph break inside Keras' name scope drops the call to eager.
        return math.prod(dims)
    shape = ops.shape(x)
    count = ops.cast(1.0, "float32")
    for i, d in zip(reduced, dims):  # In float: no int32 overflow.
        count = count * (d if d is not None else ops.cast(shape[i], "float32"))
    return count


def _empty_is_zero(count, mean, variance):
    """Zero statistics for an empty batch (the kernels return NaN), as the general path."""
    if isinstance(count, (int, float)):
        return mean, variance  # Static and non-empty: `_unsupported` refused 0.
    has_values = count > 0.0
    return ops.where(has_values, mean, 0.0), ops.where(has_values, variance, 0.0)


def _local_gradient_formula(dy, x, gamma, mean, variance, epsilon):
    """`_TensorFlowKernel.local_gradient` in plain ops, for its derivative (features last)."""
    inv = ops.rsqrt(variance + epsilon)
    axes = tuple(range(len(x.shape) - 1))
    return dy * (gamma * inv), ops.sum(dy * (x - mean), axis=axes) * inv, ops.sum(dy, axis=axes)


class _Kernel:
    """A fused kernel for one layout: the features last (rank ≥ 2) or second (4-D, 5-D)."""

    def __init__(self, channels_first):
        self.channel_axis = 1 if channels_first else -1


class _TensorFlowKernel(_Kernel):
    """`FusedBatchNormV3` on a 4-D view of the input: NHWC, `(M, 1, 1, C)` rows, or NCHW.

    A 5-D channels-first map (N, C, D, H, W) is the NCHW view (N, C, D·H, W)
    of the same memory.
    """

    def _view(self, x):
        rank = len(x.shape)
        if self.channel_axis == 1:
            if rank == 5:
                shape = ops.shape(x)
                x = ops.reshape(x, (shape[0], x.shape[1], shape[2] * shape[3], shape[4]))
            return x, "NCHW"
        return (x if rank == 4 else ops.reshape(x, (-1, 1, 1, x.shape[-1]))), "NHWC"

    def _normalize(self, x, gamma, beta, epsilon, **statistics):
        import tensorflow as tf

        view, data_format = self._view(x)
        channels = x.shape[self.channel_axis]
        y, mean, variance = tf.compat.v1.nn.fused_batch_norm(
            view,
            _vector(gamma, 1.0, channels),
            _vector(beta, 0.0, channels),
            epsilon=epsilon,
            data_format=data_format,
            **statistics,
        )
        return ops.reshape(y, ops.shape(x)), mean, variance

    def train(self, x, gamma, beta, epsilon):
        y, mean, variance = self._normalize(x, gamma, beta, epsilon, is_training=True)
        count = _count(x, self.channel_axis)
        mean, variance = _empty_is_zero(count, mean, _unbias(variance, count))
        return y, (count, mean, variance)

    def infer(self, x, mean, variance, gamma, beta, epsilon):
        statistics = {"mean": _value(mean), "variance": _value(variance), "is_training": False}
        return self._normalize(x, gamma, beta, epsilon, **statistics)[0]

    def normalize_given(self, x, gamma, beta, mean, variance, epsilon):
        """γ (x − μ) / √(σ² + ε) + β with given per-feature statistics: the inference op."""
        return self.infer(x, mean, variance, gamma, beta, epsilon)

    def local_gradient(self, dy, x, gamma, mean, variance, epsilon):
        """`(dy·γr, Σ dy·x̂, Σ dy)` over this call's values, r = 1/√(σ² + ε).

        One pass of the gradient op's inference form (`is_training=False`:
        the statistics are constants to it). Its own derivative is that of
        the same quantities written in `keras.ops`, so a second derivative
        follows μ and σ² too (TensorFlow's registered gradient of the op
        returns none for them).
        """
        import tensorflow as tf

        @ops.custom_gradient
        def fused(dy, x, gamma, mean, variance):
            view, data_format = self._view(x)
            dx, dgamma, dbeta, _, _ = tf.raw_ops.FusedBatchNormGradV3(
                y_backprop=ops.reshape(dy, ops.shape(view)),
                x=view,
                scale=gamma,
                reserve_space_1=mean,
                reserve_space_2=variance,
                reserve_space_3=mean,  # Unused by the inference form.
                epsilon=epsilon,
                data_format=data_format,
                is_training=False,
            )

            def grad(*upstream):
                inputs = [dy, x, gamma, mean, variance]
                with tf.GradientTape() as tape:
                    tape.watch(inputs)
                    outputs = _local_gradient_formula(*inputs, epsilon)
                upstream = [
                    ops.zeros_like(o) if u is None else u for u, o in zip(upstream, outputs)
                ]
                return tape.gradient(outputs, inputs, output_gradients=upstream)

            return (ops.reshape(dx, ops.shape(x)), dgamma, dbeta), grad

        return fused(dy, x, gamma, mean, variance)


class _TorchKernel(_Kernel):
    """`torch.nn.functional.batch_norm` (ATen's native kernel).

    Channels-first inputs go as they are (ATen's own layout); channels-last
    ones through a channels-last view, whose CPU kernels are faster, backward
    most, than ATen's path for a contiguous `(M, C)` matrix (3.6 vs 2.8 ms
    for a training step at (32, 14, 14, 256) on the 2-core benchmark
    machine). A 16-bit input runs with float32 statistics (ATen's mixed-type
    batch norm).
    """

    def _view(self, x):
        if self.channel_axis == 1:
            return x, lambda y: y
        return _channels_last(x)

    def train(self, x, gamma, beta, epsilon):
        import torch

        view, back = self._view(x)
        # With momentum 1 the running buffers become the batch's mean and
        # its Bessel-corrected variance.
        mean = torch.zeros(view.shape[1], dtype=torch.float32, device=view.device)
        variance = torch.zeros_like(mean)
        y = torch.nn.functional.batch_norm(
            view, mean, variance, gamma, beta, training=True, momentum=1.0, eps=epsilon
        )
        count = _count(x, self.channel_axis)
        return back(y), (count, mean, _unbias(variance, count))

    def infer(self, x, mean, variance, gamma, beta, epsilon):
        import torch

        view, back = self._view(x)
        y = torch.nn.functional.batch_norm(
            view, *[_value(v) for v in (mean, variance, gamma, beta)], training=False, eps=epsilon
        )
        return back(y)


# One instance per engine and layout serves every call (a kernel holds only its layout); a
# plain dict, which `torch.compile` traces, where it skips `functools.cache` with a warning.
_KERNELS = {
    (backend, channels_first): kernel(channels_first=channels_first)
    for backend, kernel in (("tensorflow", _TensorFlowKernel), ("torch", _TorchKernel))
    for channels_first in (False, True)
}
