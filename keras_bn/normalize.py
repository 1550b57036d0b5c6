"""Training-mode batch normalization with the compact analytic gradient.

Forward (Ioffe & Szegedy 2015, Algorithm 1), per feature over the reduced
axes, with m values (n after a cross-replica merge):
    μ = Σ x / m,  σ² = Σ (x − μ)² / m,  x̂ = (x − μ) / √(σ² + ε),  y = γ x̂ + β.
Backward, with g = ∂ℓ/∂y and r = 1 / √(σ² + ε), the paper's chain rule
through μ and σ² collapses to
    ∂ℓ/∂x = γ r (g − (Σ g + x̂ Σ g x̂) / m),  ∂ℓ/∂γ = Σ g x̂,  ∂ℓ/∂β = Σ g.
With a 0/1 mask w the statistics are weighted and the correction term is
multiplied by w. Under synchronisation the sums Σ g and Σ g x̂ in ∂ℓ/∂x are
over the replica group's batch (one packed all-reduce of 2C floats, G·2C with
G groups), while ∂ℓ/∂γ and ∂ℓ/∂β stay local: the strategy sums them across
replicas like every other gradient.
"""

from keras import ops

from keras_bn import moments


def normalize_with_batch_statistics(
    x, gamma, beta, *, axes, epsilon, weights=None, groups=None
):
    """Normalises `x` with its batch statistics and returns them.

    Args:
        x: float32 input.
        gamma: float32 scale, broadcastable to `x` (size 1 on `axes`).
        beta: float32 offset, shaped like `gamma`.
        axes: tuple of the reduced axes.
        epsilon: float, added to the variance.
        weights: `None` or a float32 0/1 mask broadcastable to `x`.
        groups: `None` for local statistics, else the `moments.ReplicaGroups`
            whose group batch supplies the statistics.

    Returns:
        `(y, mean, variance, count)`: the float32 output, the batch mean and
        biased variance shaped like `gamma`, and the float32 count m they are
        over. Only `y` carries a gradient.
    """

    @ops.custom_gradient
    def forward(x, gamma, beta):
        count, mean, m2 = moments.local_moments(x, axes, weights)
        if groups is not None:
            count, mean, m2 = groups.moments(count, mean, m2)
        variance = ops.divide_no_nan(m2, count)
        inv = ops.rsqrt(variance + epsilon)
        scale = gamma * inv
        y = x * scale + (beta - mean * scale)

        def grad(dy, *unused_statistics_grads, **unused_kwargs):
            dy = ops.cast(dy, "float32")
            # Recomputed rather than kept from the forward pass: holding one
            # more full-size tensor per layer until the backward pass costs
            # more memory traffic than the subtraction.
            centered = x - mean
            sum_dy = ops.sum(dy, axis=axes, keepdims=True)
            sum_dy_xhat = (
                ops.sum(dy * centered, axis=axes, keepdims=True) * inv
            )
            global_dy, global_dy_xhat = sum_dy, sum_dy_xhat
            if groups is not None:
                global_dy, global_dy_xhat = groups.sum([sum_dy, sum_dy_xhat])
            coef_const = ops.divide_no_nan(scale * global_dy, count)
            coef_centered = ops.divide_no_nan(
                scale * inv * global_dy_xhat, count
            )
            correction = coef_centered * centered + coef_const
            if weights is not None:
                correction = correction * weights
            dx = dy * scale - correction
            return dx, sum_dy_xhat, sum_dy

        return (y, mean, variance, count), grad

    y, mean, variance, count = forward(x, gamma, beta)
    return (
        y,
        ops.stop_gradient(mean),
        ops.stop_gradient(variance),
        ops.stop_gradient(count),
    )


def normalize_with_statistics(x, mean, variance, gamma, beta, epsilon):
    """Inference normalisation y = γ (x − μ) / √(σ² + ε) + β as one FMA."""
    scale = gamma * ops.rsqrt(variance + epsilon)
    return x * scale + (beta - mean * scale)
