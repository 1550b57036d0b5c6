"""A float64 NumPy training call with its first and second derivatives.

The reference of the conformance matrix (`keras_bn/conformance_test.py`):
the paper's training-mode transform over any feature axes, with consecutive
slices of the batch normalised on their own (ghost batches, replica groups,
`keras.distribution` replicas), a 0/1 mask and Batch Renormalization's
(r, d) held fixed, as the layer holds them out of the gradient. First
derivatives are the paper's backward formulas; directional second
derivatives (Hessian-vector products) and forward-mode tangents are central
differences of them in float64 with Richardson extrapolation (error O(h⁴),
about 1e-11 relative at these sizes).

The scalar every cell differentiates is the loss
    L(y) = Σ w₁ y + ½ Σ (w₂ y)²,
whose Hessian in y is not zero, so second derivatives see both the loss and
the normalisation.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a training call normalises over.

    Attributes:
        feature_axes: the non-negative feature axes.
        epsilon: the layer's ε.
        slices: consecutive slices of the batch axis, each normalised alone.
        weights: `None` or a 0/1 array of `x`'s rank (a mask, broadcastable).
        clipping: `None`, or renorm's clipping dict (its r and d, computed at
            the initial renorm statistics μ_R = 0, σ_R = 1 from the first
            batch a `Reference` sees, are then frozen for its derivatives).
        statistics: `None`, or the per-feature (mean, variance) that
            normalise instead of the batch's (`statistics="moving"`): constants
            to every derivative.
    """

    feature_axes: tuple
    epsilon: float = 1e-3
    slices: int = 1
    weights: np.ndarray | None = None
    clipping: dict | None = None
    statistics: tuple | None = None


def _split(a, slices):
    return np.reshape(a, (slices, -1, *np.shape(a)[1:]))


def _axes(setting, rank):
    reduced = tuple(i for i in range(rank) if i not in setting.feature_axes)
    return (1,) + tuple(a + 1 for a in reduced if a != 0)


def _parameter(value, setting, rank):
    shape = [1] * (rank + 1)
    for axis, size in zip(setting.feature_axes, np.shape(value)):
        shape[axis + 1] = size
    return np.reshape(np.asarray(value, np.float64), shape)


class Reference:
    """The float64 training call of one `Setting` with fixed γ, β, w₁ and w₂."""

    def __init__(self, setting, gamma, beta, w1, w2):
        self.setting = setting
        self.gamma, self.beta = gamma, beta
        self.w1, self.w2 = np.asarray(w1, np.float64), np.asarray(w2, np.float64)
        self.frozen = None

    def _pieces(self, x):
        s = self.setting
        x = np.asarray(x, np.float64)
        rank, axes = x.ndim, _axes(s, x.ndim)
        xs = _split(x, s.slices)
        w = (
            np.ones_like(xs)
            if s.weights is None
            else _split(np.broadcast_to(s.weights, x.shape), s.slices)
        )
        count = np.sum(w, axes, keepdims=True)
        mean = np.sum(w * xs, axes, keepdims=True) / count
        variance = np.sum(w * (xs - mean) ** 2, axes, keepdims=True) / count
        if s.statistics is not None:
            mean, variance = (_parameter(v, s, rank) for v in s.statistics)
        inv = 1.0 / np.sqrt(variance + s.epsilon)
        if self.frozen is None:
            r, d = np.ones_like(mean), np.zeros_like(mean)
            if s.clipping is not None:
                c = s.clipping
                r = np.clip(np.sqrt(variance + s.epsilon), c.get("rmin", 0), c.get("rmax", np.inf))
                d = np.clip(mean, -c.get("dmax", np.inf), c.get("dmax", np.inf))
            self.frozen = (r, d)
        gamma = _parameter(self.gamma, s, rank)
        beta = _parameter(self.beta, s, rank)
        return x, xs, w, axes, count, mean, variance, inv, gamma, beta

    def output(self, x):
        """y of the training call."""
        x, xs, _, _, _, mean, _, inv, gamma, beta = self._pieces(x)
        r, d = self.frozen
        y = gamma * (r * (xs - mean) * inv + d) + beta
        return y.reshape(x.shape)

    def upstream(self, y):
        """∂L/∂y."""
        return self.w1 + self.w2**2 * y

    def loss(self, y):
        return float(np.sum(self.w1 * y) + 0.5 * np.sum((self.w2 * y) ** 2))

    def gradients(self, x):
        """(∂L/∂x, ∂L/∂γ, ∂L/∂β): the paper's backward pass."""
        x, xs, w, axes, count, mean, _, inv, gamma, _ = self._pieces(x)
        r, d = self.frozen
        g = _split(self.upstream(self.output(x)), self.setting.slices)
        x_hat = (xs - mean) * inv
        sum_g = np.sum(g, axes, keepdims=True)
        sum_g_xhat = np.sum(g * x_hat, axes, keepdims=True)
        if self.setting.statistics is not None:  # Constants: no path through μ and σ².
            sum_g = sum_g_xhat = 0.0
        dx = gamma * r * inv * (g - w * (sum_g + x_hat * sum_g_xhat) / count)
        outer = tuple(i for i in range(x.ndim + 1) if i - 1 not in self.setting.feature_axes)
        dgamma = np.sum(g * (r * x_hat + d), outer)
        dbeta = np.sum(g, outer)
        return dx.reshape(x.shape), dgamma, dbeta

    def hessian_vector(self, x, v):
        """∂²L/∂x² · v."""
        return _richardson(lambda t: self.gradients(x + t * v)[0])

    def tangent(self, x, v):
        """∂y/∂x · v (forward mode)."""
        return _richardson(lambda t: self.output(x + t * v))

    def moments(self, x):
        """(values per feature in one slice, pooled mean, pooled biased variance), flat.

        What the moving statistics move towards: the count-weighted mean of
        the slices' means and of their variances.
        """
        _, _, _, _, count, mean, variance, _, _, _ = self._pieces(x)
        count = np.broadcast_to(count, mean.shape)
        total = np.sum(count, 0)
        return (
            (total / self.setting.slices).reshape(-1),
            (np.sum(count * mean, 0) / total).reshape(-1),
            (np.sum(count * variance, 0) / total).reshape(-1),
        )


def _richardson(f, h=1e-3):
    """f'(0) from central differences at h and h/2 (error O(h⁴))."""

    def central(step):
        return (f(step) - f(-step)) / (2.0 * step)

    return (4.0 * central(h / 2) - central(h)) / 3.0


def moving_statistics(
    batches,
    *,
    momentum=0.99,
    unbiased=False,
    warmup=False,
    renorm=False,
    epsilon=1e-3,
    accumulation_steps=None,
):
    """The moving (mean, variance) after training batches of pooled moments.

    Args:
        batches: a list of `(count, mean, variance)` from `Reference.moments`
            (count: values per feature of one slice).
        momentum, unbiased, warmup, renorm: the layer's rule, from the
            initial state mean 0, variance 1 (renorm: stddev 1).
        accumulation_steps: `None`, or k: each k consecutive batches pool
            into one (count-weighted mean of means and of variances, those
            of one value or none left out); a last incomplete k moves nothing.

    A batch of one value per feature or none leaves the state unchanged.
    """
    shape = np.shape(batches[0][1])
    if accumulation_steps:
        k = accumulation_steps
        batches = [_pooled(batches[i : i + k]) for i in range(0, len(batches) - k + 1, k)]
    mean, variance, stddev, seen = 0.0, 1.0, 1.0, 0
    for count, batch_mean, batch_variance in batches:
        count = np.asarray(count, np.float64)
        if np.all(count <= 1):
            continue
        if unbiased:
            batch_variance = batch_variance * count / (count - 1)
        if momentum is None:
            rate = 1.0 / (seen + 1)
        elif warmup:
            rate = 1.0 - min(momentum, (1.0 + seen) / (10.0 + seen))
        else:
            rate = 1.0 - momentum
        seen += 1
        mean = mean * (1 - rate) + batch_mean * rate
        if renorm:
            stddev = stddev * (1 - rate) + np.sqrt(batch_variance + epsilon) * rate
            variance = np.maximum(stddev**2 - epsilon, 0.0)
        else:
            variance = variance * (1 - rate) + batch_variance * rate
    return np.broadcast_to(mean, shape), np.broadcast_to(variance, shape)


def _pooled(batches):
    """k batches' `(count, mean, variance)` as the one `accumulation_steps` moves with."""
    counts = np.asarray([np.asarray(c, np.float64) for c, _, _ in batches])
    weights = np.where(counts > 1, counts, 0.0)
    total = weights.sum(0)
    safe = np.where(total > 0, total, 1.0)
    mean = sum(w * np.asarray(m, np.float64) for w, (_, m, _) in zip(weights, batches)) / safe
    variance = sum(w * np.asarray(v, np.float64) for w, (_, _, v) in zip(weights, batches)) / safe
    with_values = (counts > 1).sum(0)
    return total / np.where(with_values > 0, with_values, 1), mean, variance
