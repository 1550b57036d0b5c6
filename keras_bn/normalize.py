"""Training-mode batch normalization with the compact analytic gradient.

Forward (Ioffe & Szegedy 2015, Algorithm 1), per feature over the reduced
axes, with m values (n after a cross-replica merge):
    μ = Σ x / m,  σ² = Σ (x − μ)² / m,  x̂ = (x − μ) / √(σ² + ε),  y = γ x̂ + β.
Backward, with g = ∂ℓ/∂y and r = 1 / √(σ² + ε), the paper's chain rule
through μ and σ² collapses to
    ∂ℓ/∂x = γ r (g − (Σ g + x̂ Σ g x̂) / m),  ∂ℓ/∂γ = Σ g x̂,  ∂ℓ/∂β = Σ g.
With a 0/1 mask w the statistics are weighted (m counts the unmasked values
of each feature) and the correction term is multiplied by w. Under
synchronisation the sums Σ g and Σ g x̂ in ∂ℓ/∂x are over the replica group's
batch (one packed all-reduce of 2C floats, G·2C with G groups), while ∂ℓ/∂γ
and ∂ℓ/∂β stay local: the strategy sums them across replicas like every
other gradient.

The statistics are computed first (`moments.batch_moments`, no gradient) and passed
to `normalize_with_batch_statistics`, whose custom gradient accounts for
their dependence on x analytically; so a caller can derive other quantities
from them (Batch Renormalization's r and d) before normalising. Everything
is in `keras.ops`, so it runs on every Keras backend.
"""

from keras import ops


def normalize_with_batch_statistics(
    x, gamma, beta, mean, variance, count, *, axes, epsilon, weights=None, groups=None
):
    """Normalises `x` with its own batch statistics `(count, mean, variance)`.

    Args:
        x: float input.
        gamma: scale of `x`'s dtype, broadcastable to `x` (size 1 on `axes`).
        beta: offset, shaped like `gamma`.
        mean, variance, count: `moments.batch_moments(x, axes, weights, groups)`.
        axes: tuple of the reduced axes.
        epsilon: float, added to the variance.
        weights: `None` or the 0/1 mask the statistics were computed with.
        groups: `None` or the `moments.ReplicaGroups` they were merged over.

    Returns:
        The output `y` in `x`'s dtype. Its gradient with respect to `x`
        includes the paths through the batch mean and variance.
    """

    @ops.custom_gradient
    def forward(x, gamma, beta, mean, variance, count):
        inv = ops.rsqrt(variance + epsilon)
        scale = gamma * inv
        y = x * scale + (beta - mean * scale)

        def grad(*args, upstream=None):
            # TensorFlow and JAX pass the output's cotangent positionally,
            # PyTorch as `upstream` (after the inputs).
            dy = ops.cast(args[0] if upstream is None else upstream, x.dtype)
            # Recomputed rather than kept from the forward pass: holding one
            # more full-size tensor per layer until the backward pass costs
            # more memory traffic than the subtraction.
            centered = x - mean
            if weights is not None:
                # A masked-out non-finite value's own output is non-finite,
                # but it must not reach the other values' gradients.
                centered = ops.where(
                    ops.logical_or(weights > 0.0, ops.isfinite(centered)), centered, 0.0
                )
            sum_dy = ops.sum(dy, axis=axes, keepdims=True)
            sum_dy_xhat = ops.sum(dy * centered, axis=axes, keepdims=True) * inv
            group_dy, group_dy_xhat = sum_dy, sum_dy_xhat
            if groups is not None:
                group_dy, group_dy_xhat = groups.sum([sum_dy, sum_dy_xhat])
            coef_const = ops.divide_no_nan(scale * group_dy, count)
            coef_centered = ops.divide_no_nan(scale * inv * group_dy_xhat, count)
            correction = coef_centered * centered + coef_const
            if weights is not None:
                correction = correction * weights
            dx = dy * scale - correction
            # The statistics' own cotangents are zero: their dependence on x
            # is already in dx.
            return (
                dx,
                _sum_to_shape(sum_dy_xhat, gamma.shape),
                _sum_to_shape(sum_dy, beta.shape),
                ops.zeros_like(mean),
                ops.zeros_like(variance),
                ops.zeros_like(count),
            )

        return y, grad

    return forward(x, gamma, beta, mean, variance, count)


def _sum_to_shape(value, shape):
    """Sums `value` over the axes that `shape` broadcasts (size 1 there).

    With batch slices (ghost batches) the per-slice sums Σ g and Σ g x̂ have
    a slice axis that γ and β, shared by all slices, do not.
    """
    axes = tuple(i for i, (v, t) in enumerate(zip(value.shape, shape)) if t == 1 and v != 1)
    return ops.sum(value, axis=axes, keepdims=True) if axes else value


def normalize_with_statistics(x, mean, variance, gamma, beta, epsilon):
    """Inference normalisation y = γ (x − μ) / √(σ² + ε) + β as one FMA."""
    scale = gamma * ops.rsqrt(variance + epsilon)
    return x * scale + (beta - mean * scale)
