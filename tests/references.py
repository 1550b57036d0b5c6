"""NumPy float64 references of batch normalisation, written from the paper."""

import numpy as np


def reduction_axes(rank, feature_axes):
    feature_axes = {a % rank for a in feature_axes}
    return tuple(i for i in range(rank) if i not in feature_axes)


def reference_moments(x, feature_axes):
    """Batch mean and biased variance, kept as size-1 on reduced axes."""
    x = np.asarray(x, np.float64)
    axes = reduction_axes(x.ndim, feature_axes)
    mean = x.mean(axis=axes, keepdims=True)
    variance = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    return mean, variance


def reference_batch_norm(x, gamma, beta, feature_axes, epsilon):
    """Algorithm 1 in float64; gamma/beta broadcast over the reduced axes."""
    mean, variance = reference_moments(x, feature_axes)
    x_hat = (np.asarray(x, np.float64) - mean) / np.sqrt(variance + epsilon)
    return gamma * x_hat + beta


def broadcast_param(param, rank, feature_axes):
    """Reshapes a parameter of the feature shape to broadcast against x."""
    feature_axes = sorted(a % rank for a in feature_axes)
    shape = [1] * rank
    for axis, size in zip(feature_axes, np.shape(param)):
        shape[axis] = size
    return np.reshape(param, shape)


def reference_sliced_batch_norm(x, upstream, gamma, beta, slices, epsilon):
    """Training BN of a 2-D batch split into `slices` consecutive slices, in float64.

    Each slice of B/S examples is normalised with its own moments; the
    gradients follow the paper's backward pass per slice, with upstream
    gradient `upstream` (the loss is Σ upstream·y).

    Returns:
        dict with "y", "dx", "dgamma", "dbeta", and "mean", "variance":
        the slices' mean moments (the pooled mean and within-slice
        variance the layer's moving statistics move towards).
    """
    x = np.asarray(x, np.float64).reshape(slices, -1, np.shape(x)[-1])
    g = np.asarray(upstream, np.float64).reshape(x.shape)
    m = x.shape[1]
    mean = x.mean(1, keepdims=True)
    variance = ((x - mean) ** 2).mean(1, keepdims=True)
    inv = 1.0 / np.sqrt(variance + epsilon)
    x_hat = (x - mean) * inv
    y = gamma * x_hat + beta
    sum_g, sum_g_xhat = g.sum(1, keepdims=True), (g * x_hat).sum(1, keepdims=True)
    dx = gamma * inv * (g - (sum_g + x_hat * sum_g_xhat) / m)
    flat = (-1, x.shape[-1])
    return {
        "y": y.reshape(flat),
        "dx": dx.reshape(flat),
        "dgamma": sum_g_xhat.sum((0, 1)),
        "dbeta": sum_g.sum((0, 1)),
        "mean": mean.mean((0, 1)),
        "variance": variance.mean((0, 1)),
    }
