"""NumPy references shared by the tests (float64, written from the paper)."""

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
