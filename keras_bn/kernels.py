"""Which kernel normalises a call: the engine's fused batch norm, or the general path.

`choose` is the one decision. The general path (`keras_bn.normalize`, plain
`keras.ops`) runs every case on every backend. Where an engine ships a fused
batch-norm kernel with the same meaning, and measurements showed it faster
there (docs/benchmarks.md), a call that kernel can express runs through it:

- TensorFlow: `FusedBatchNormV3` (`tf.compat.v1.nn.fused_batch_norm`), in
  training and inference, on GPU, and on CPU when TensorFlow's oneDNN
  kernels are on;
- PyTorch: `torch.nn.functional.batch_norm` (ATen's native kernel), in
  training and inference, on every device;
- JAX: none; XLA fuses the general path.

A call can use a fused kernel when its input is float32 with one feature
axis, the last (a 2-D `(N, C)` input included), ε is at least 1.001e-5 (the
least TensorFlow's kernel accepts; it would raise a smaller one) and, in
training, it has no mask, no Batch Renormalization, no ghost batches or
`keras.distribution` slices and no cross-replica merge. Everything else,
float64 and float16 statistics-free inputs included, takes the general path.

Both kernels normalise with the biased batch variance and return the
Bessel-corrected m/(m−1)·σ²_B (TensorFlow as its batch variance, PyTorch in
the running variance it writes with momentum 1); the kernel here undoes the
correction, so the moving-statistics update rule sees the same biased σ²_B as
on the general path and applies `unbiased_variance` itself.

TensorFlow's oneDNN kernels are on by default only on some CPUs (and off with
`TF_ENABLE_ONEDNN_OPTS=0`); without them its CPU fused kernel was no faster
than the general path at some shapes and slower at others, so the rule keeps
the general path there. `fused=False` on the layer forces the general path
everywhere; `fused=True` asks for the fused kernel and raises where this
engine and call cannot use one.
"""

import functools
import os

import keras
from keras import ops

# TensorFlow's kernel refuses a smaller epsilon (cuDNN's least).
MIN_FUSED_EPSILON = 1.001e-5


def choose(x, reduction_axes, epsilon, *, fused, plain):
    """The fused kernel for a call, or `None` for the general path.

    Args:
        x: the call's input in the statistics' dtype.
        reduction_axes: the axes its statistics reduce (sorted, non-negative).
        epsilon: the layer's ε.
        fused: the layer's `fused` argument: `None` (the measured rule),
            `True` (required) or `False` (never).
        plain: whether the call has none of what only the general path
            expresses (mask, renorm, slices, cross-replica merge); always
            true for inference.

    Returns:
        A kernel with `train(x, gamma, beta, epsilon)` and
        `infer(x, mean, variance, gamma, beta, epsilon)`, or `None`.

    Raises:
        ValueError: with `fused=True` when no fused kernel can run the call.
    """
    if fused is False:
        return None
    reason = _unsupported(x, reduction_axes, epsilon, plain)
    if reason is None and fused is None and not _faster_here():
        reason = "the measured rule keeps the general path on this platform"
    if reason is None:
        return _KERNELS[keras.backend.backend()]
    if fused:
        raise ValueError(
            f"fused=True needs a fused batch-norm kernel, but {reason}. Pass fused=None to "
            "choose automatically. Received: fused=True"
        )
    return None


def _unsupported(x, reduction_axes, epsilon, plain):
    """Why no fused kernel can run this call, or `None`."""
    backend = keras.backend.backend()
    rank = len(x.shape)
    if backend not in _KERNELS:
        return f"the {backend} backend has none (XLA fuses the general path)"
    if not plain:
        return "masks, renorm, ghost batches, slices and synchronised moments need the general path"
    if keras.backend.standardize_dtype(x.dtype) != "float32":
        return f"its kernel here runs float32 statistics, not {x.dtype}"
    if rank < 2 or tuple(reduction_axes) != tuple(range(rank - 1)):
        return "its features must be the one last axis of an input of rank 2 or more"
    if 0 in x.shape:
        return "the batch is empty"
    if epsilon < MIN_FUSED_EPSILON:
        return f"epsilon={epsilon} is below its least {MIN_FUSED_EPSILON}"
    return None


def _faster_here():
    """The measured rule: whether this engine's fused kernel is the faster path here."""
    if keras.backend.backend() != "tensorflow":
        return True
    import tensorflow as tf  # Only the TensorFlow rule looks at devices.

    return bool(tf.config.list_logical_devices("GPU")) or tensorflow_onednn_enabled()


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


def _rows(x):
    """`x` as `(M, C)`: every feature-last layout is contiguous rows of C."""
    return ops.reshape(x, (-1, x.shape[-1]))


def _unbias(variance, count):
    """σ²_B from a kernel's m/(m−1)·σ²_B (m = 1 is refused before it runs)."""
    return variance * ((count - 1.0) / ops.maximum(count, 1.0))


class _TensorFlowKernel:
    """`FusedBatchNormV3` on an `(M, 1, 1, C)` view of the input."""

    @staticmethod
    def _nhwc(x):
        return x if len(x.shape) == 4 else ops.reshape(x, (-1, 1, 1, x.shape[-1]))

    def train(self, x, gamma, beta, epsilon):
        import tensorflow as tf

        y, mean, variance = tf.compat.v1.nn.fused_batch_norm(
            self._nhwc(x), gamma, beta, epsilon=epsilon, is_training=True
        )
        count = ops.cast(ops.size(x) // x.shape[-1], x.dtype)
        return ops.reshape(y, ops.shape(x)), (count, mean, _unbias(variance, count))

    def infer(self, x, mean, variance, gamma, beta, epsilon):
        import tensorflow as tf

        y, _, _ = tf.compat.v1.nn.fused_batch_norm(
            self._nhwc(x), gamma, beta, mean, variance, epsilon=epsilon, is_training=False
        )
        return ops.reshape(y, ops.shape(x))


class _TorchKernel:
    """`torch.nn.functional.batch_norm` (ATen's native kernel) on `(M, C)` rows."""

    def train(self, x, gamma, beta, epsilon):
        import torch

        rows = _rows(x)
        # With momentum 1 the running buffers become the batch's mean and
        # its Bessel-corrected variance.
        mean = torch.zeros(rows.shape[1], dtype=rows.dtype, device=rows.device)
        variance = torch.zeros_like(mean)
        y = torch.nn.functional.batch_norm(
            rows, mean, variance, gamma, beta, training=True, momentum=1.0, eps=epsilon
        )
        count = ops.cast(rows.shape[0], x.dtype)
        return ops.reshape(y, x.shape), (count, mean, _unbias(variance, count))

    def infer(self, x, mean, variance, gamma, beta, epsilon):
        import torch

        y = torch.nn.functional.batch_norm(
            _rows(x), mean, variance, gamma, beta, training=False, eps=epsilon
        )
        return ops.reshape(y, x.shape)


_KERNELS = {"tensorflow": _TensorFlowKernel(), "torch": _TorchKernel()}
