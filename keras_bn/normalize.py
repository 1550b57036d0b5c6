"""Training-mode batch normalization with a compact derivative of any order.

Forward (Ioffe & Szegedy 2015, Algorithm 1), per feature over the reduced
axes, with m values (n after a cross-replica merge):
    μ = Σ x / m,  σ² = Σ (x − μ)² / m,  x̂ = (x − μ) / √(σ² + ε),  y = γ x̂ + β.
With r = 1 / √(σ² + ε) and c = x − μ, the paper's chain rule through μ and
σ² collapses to the directional derivative (forward mode)
    dy = γ r dx + c (r dγ − γ r³ Σ c dx / m) + dβ − γ r Σ dx / m
and its adjoint (reverse mode), with g = ∂ℓ/∂y,
    ∂ℓ/∂x = γ r (g − (Σ g + x̂ Σ g x̂) / m),  ∂ℓ/∂γ = Σ g x̂,  ∂ℓ/∂β = Σ g.
With a 0/1 mask w the statistics are weighted (m counts the unmasked values
of each feature) and the sums over dx, like the correction term of ∂ℓ/∂x,
are multiplied by w. Under synchronisation the sums Σ g and Σ g x̂ in ∂ℓ/∂x
are over the replica group's batch (one packed all-reduce of 2C floats, G·2C
with G groups), while ∂ℓ/∂γ and ∂ℓ/∂β stay local: the strategy sums them
across replicas like every other gradient.

The statistics are computed first (`moments.batch_moments`) and passed in,
so a caller can derive other quantities from them (Batch Renormalization's
r and d) before normalising. They are differentiable functions of x, and the
rule here is the total derivative through them, so the rule ignores their
own tangents (cotangents `None`): the moments' backward never runs in a
first-order step (XLA and `tf.function` prune it; PyTorch's and eager
TensorFlow's tapes still record it, holding x − μ until the backward pass),
while a second derivative, which differentiates the rule itself, follows
μ(x) and σ²(x) through the ops that computed them. That is
why the rule recomputes everything from its inputs rather than from values
kept by the forward pass (TensorFlow and PyTorch record a custom gradient's
forward pass for no outer derivative).

Per engine, the rule is the one each differentiates to any order: on JAX a
`jax.custom_jvp` (forward mode, and reverse mode by transposing it), on
TensorFlow and PyTorch `keras.ops.custom_gradient` (nested tapes,
`create_graph=True`). The two give the same first-order arithmetic.
"""

import keras
from keras import ops

from keras_bn import moments


def normalize_with_batch_statistics(
    x, gamma, beta, mean, variance, count, *, axes, epsilon, weights=None, groups=None, kernel=None
):
    """Normalises `x` with its own batch statistics `(count, mean, variance)`.

    Args:
        x: float input.
        gamma: scale of `x`'s dtype, broadcastable to `x` (size 1 on `axes`).
        beta: offset, shaped like `gamma`.
        mean, variance, count: `moments.batch_moments(x, axes, weights, groups)`,
            computed from `x` with their gradient.
        axes: tuple of the reduced axes.
        epsilon: float, added to the variance.
        weights: `None` or the 0/1 mask the statistics were computed with.
        groups: `None` or the `moments.ReplicaGroups` they were merged over
            (TensorFlow only).
        kernel: `None`, or `kernels.choose_for_merged_moments`'s kernel
            (TensorFlow, no mask, features last): it computes the output and
            the local sums of the gradient in fused passes.

    Returns:
        The output `y` in `x`'s dtype. Its derivatives of every order with
        respect to `x`, `gamma` and `beta` include the paths through the
        batch mean and variance.
    """
    if keras.backend.backend() == "jax":
        # JAX's replicas are slices of one batch (`batch_plan`): no collective here.
        assert groups is None, "replica groups merge moments only under tf.distribute"
        return _jax_normalize(x, gamma, beta, mean, variance, count, axes, epsilon, weights)

    @ops.custom_gradient
    def forward(x, gamma, beta, mean, variance):
        def grad(*args, upstream=None):
            # TensorFlow and JAX pass the output's cotangent positionally,
            # PyTorch as `upstream` (after the inputs).
            dy = ops.cast(args[0] if upstream is None else upstream, x.dtype)
            inv = ops.rsqrt(variance + epsilon)
            scale = gamma * inv
            # Recomputed rather than kept from the forward pass: holding one
            # more full-size tensor per layer until the backward pass costs
            # more memory traffic than the subtraction.
            centered = _centered(x, mean, weights)
            if kernel is None:
                scaled_dy = dy * scale
                sum_dy = ops.sum(dy, axis=axes, keepdims=True)
                sum_dy_xhat = ops.sum(dy * centered, axis=axes, keepdims=True) * inv
            else:
                scaled_dy, sum_dy_xhat, sum_dy = kernel.local_gradient(
                    dy, x, *[_vector(v) for v in (gamma, mean, variance)], epsilon
                )
                sum_dy_xhat, sum_dy = [
                    ops.reshape(v, ops.shape(mean)) for v in (sum_dy_xhat, sum_dy)
                ]
            group_dy, group_dy_xhat = sum_dy, sum_dy_xhat
            if groups is not None:
                group_dy, group_dy_xhat = groups.sum([sum_dy, sum_dy_xhat])
            coef_const = moments.over_count(scale * group_dy, count)
            coef_centered = moments.over_count(scale * inv * group_dy_xhat, count)
            correction = coef_centered * centered + coef_const
            if weights is not None:
                correction = correction * weights
            dx = scaled_dy - correction
            return (
                dx,
                _sum_to_shape(sum_dy_xhat, gamma.shape),
                _sum_to_shape(sum_dy, beta.shape),
                None,  # μ and σ²: their dependence on x is in dx.
                None,
            )

        if kernel is not None:
            vectors = [_vector(v) for v in (gamma, beta, mean, variance)]
            return kernel.normalize_given(x, *vectors, epsilon), grad
        return _affine(x, gamma, beta, mean, variance, epsilon), grad

    return forward(x, gamma, beta, mean, variance)


def _jax_normalize(x, gamma, beta, mean, variance, count, axes, epsilon, weights):
    """The same normalisation as a `jax.custom_jvp`: forward mode, and any order."""
    import jax  # The JAX backend is running.

    @jax.custom_jvp
    def forward(x, gamma, beta, mean, variance, count, weights):
        return _affine(x, gamma, beta, mean, variance, epsilon)

    @forward.defjvp
    def tangent(primals, tangents):
        x, gamma, beta, mean, variance, count, weights = primals
        dx, dgamma, dbeta = tangents[:3]  # μ and σ²'s tangents: already in the rule.
        inv = ops.rsqrt(variance + epsilon)
        scale = gamma * inv
        centered = _centered(x, mean, weights)
        masked_dx = dx if weights is None else dx * weights
        sums = [ops.sum(t, axis=axes, keepdims=True) for t in (masked_dx, centered * masked_dx)]
        mean_dx, mean_cdx = [moments.over_count(total, count) for total in sums]
        # One full-size product with c: XLA then keeps x, not x̂, for the
        # backward pass (the transposed rule), as fast as a hand-written one.
        per_centered = inv * dgamma - scale * inv * inv * mean_cdx
        dy = scale * dx + centered * per_centered + (dbeta - scale * mean_dx)
        return _affine(x, gamma, beta, mean, variance, epsilon), dy

    return forward(x, gamma, beta, mean, variance, count, weights)


def _affine(x, gamma, beta, mean, variance, epsilon):
    """γ (x − μ) / √(σ² + ε) + β as one multiply-add per value."""
    scale = gamma * ops.rsqrt(variance + epsilon)
    return x * scale + (beta - mean * scale)


def _centered(x, mean, weights):
    """x − μ, with masked-out non-finite values set to 0.

    A masked-out NaN or inf keeps its own (non-finite) output, but must not
    reach the sums that every other value's derivative takes.
    """
    centered = x - mean
    if weights is None:
        return centered
    return ops.where(ops.logical_or(weights > 0.0, ops.isfinite(centered)), centered, 0.0)


def _vector(value):
    """A per-feature statistic of shape (1, …, 1, C) as the (C,) vector a kernel takes."""
    return ops.reshape(value, (-1,))


def _sum_to_shape(value, shape):
    """Sums `value` over the axes that `shape` broadcasts (size 1 there).

    With batch slices (ghost batches) the per-slice sums Σ g and Σ g x̂ have
    a slice axis that γ and β, shared by all slices, do not.
    """
    axes = tuple(i for i, (v, t) in enumerate(zip(value.shape, shape)) if t == 1 and v != 1)
    return ops.sum(value, axis=axes, keepdims=True) if axes else value


def normalize_with_statistics(x, mean, variance, gamma, beta, epsilon):
    """Inference normalisation y = γ (x − μ) / √(σ² + ε) + β as one FMA."""
    return _affine(x, gamma, beta, mean, variance, epsilon)


def renorm_correction(mean, variance, renorm_mean, renorm_stddev, epsilon, clipping):
    """Batch Renormalization's (r, d) (Ioffe 2017), clipped and held out of the gradient.

    r = σ_B / σ_R and d = (μ_B − μ_R) / σ_R with σ_B = √(σ²_B + ε), clipped to
    [rmin, rmax] and [−dmax, dmax] by the keys `clipping` has.
    """
    stddev = ops.sqrt(variance + epsilon)
    # σ_R at least √ε: no division by zero early in training.
    renorm_stddev = ops.maximum(renorm_stddev, ops.cast(epsilon, renorm_stddev.dtype) ** 0.5)
    r = stddev / renorm_stddev
    d = (mean - renorm_mean) / renorm_stddev
    if "rmin" in clipping:
        r = ops.maximum(r, clipping["rmin"])
    if "rmax" in clipping:
        r = ops.minimum(r, clipping["rmax"])
    if "dmax" in clipping:
        d = ops.clip(d, -clipping["dmax"], clipping["dmax"])
    return ops.stop_gradient(r), ops.stop_gradient(d)
