"""The moving-statistics update rule, as one pure function.

`update` takes the current moving statistics and one training batch's
moments and returns the new values; `BatchNormalization` assigns them after
each training step, and `estimate_population_statistics` accumulates its
population averages with the same rule. With gradient accumulation
(`accumulation_steps=k`) the batch is a micro-batch: its moments are merged
into accumulators (`ACCUMULATORS`), and every k-th the statistics take one
step from the merge.
"""

import dataclasses

import keras
from keras import ops

from keras_bn import moments

try:  # Keras has no public query; its own check, imported once (`torch.compile` traces it).
    from keras.src.backend.common.stateless_scope import in_stateless_scope as _keras_query
except ImportError:  # Another Keras: assume a scope, and assign.
    _keras_query = None


@dataclasses.dataclass(frozen=True)
class Rule:
    """The settings of the update rule (a layer's own, see `BatchNormalization`).

    Attributes:
        momentum: float in [0, 1), the weight of the old value; `None` for
            the exact cumulative average over batches.
        unbiased_variance: accumulate m/(m−1)·σ²_B instead of σ²_B.
        epsilon: the layer's ε (renorm's statistics are standard deviations
            √(v + ε)).
        renorm_momentum: Batch Renormalization's momentum, or `None` without
            renorm.
        skip_nonfinite: keep every statistic as it was when the batch's
            mean or variance has a non-finite value.
        count_skipped: count those skips in "skipped_updates" (with
            `skip_nonfinite`).
        momentum_warmup: use min(momentum, (1 + t)/(10 + t)) at update t
            (TensorFlow's `ExponentialMovingAverage(num_updates=t)` rule).
        accumulation_steps: `None`, or k: one update per k batches, from
            their merged moments (`update`).
    """

    momentum: float | None
    unbiased_variance: bool
    epsilon: float
    renorm_momentum: float | None = None
    skip_nonfinite: bool = False
    count_skipped: bool = False
    momentum_warmup: bool = False
    accumulation_steps: int | None = None


# The state of `accumulation_steps`: micro-batches seen (a scalar), and per
# feature those with values, their summed counts, count-weighted mean and
# count-weighted (biased) variance.
ACCUMULATORS = (
    "accumulated_steps",
    "accumulated_batches",
    "accumulated_count",
    "accumulated_mean",
    "accumulated_variance",
)


def update(rule, state, mean, variance, count, weight=1.0):
    """The moving statistics after one training batch.

    With a float momentum every statistic moves as
    s ← s·momentum + b·(1 − momentum), computed as s + (b − s)·(1 − momentum);
    with `momentum=None` as the exact running average s ← s + (b − s)·w / W,
    where W = `moving_batches` + w
    accumulates the batches' weights w (1 each in training). Features with
    one value or none in the batch (count ≤ 1: no spread to measure) keep
    their statistics; the cumulative weight advances if any feature moved.
    With renorm the inference variance tracks the standard deviation:
    `moving_stddev` averages √(v + ε)
    and `moving_variance` = moving_stddev² − ε (at least 0); `renorm_mean`
    and `renorm_stddev` average μ_B and √(σ²_B + ε) with `renorm_momentum`.

    With `rule.momentum_warmup` the momentum at update t ("num_updates",
    counting the updates with values) is min(momentum, (1 + t)/(10 + t)),
    so early statistics are not dominated by their initial values. With
    `rule.skip_nonfinite` a batch whose mean or variance holds a non-finite
    value in any feature leaves the whole state unchanged (counts, warm-up
    step and renorm statistics included); with `rule.count_skipped` it adds 1
    to "skipped_updates", as does a batch with values that moved no feature
    (one value per feature); an empty batch is not counted.

    With `rule.accumulation_steps=k` the batch is one of k micro-batches
    (`_after_accumulation`): the state changes once per k batches, as above,
    from their pooled moments.

    Args:
        rule: the `Rule`.
        state: dict of the current values: "moving_mean", "moving_variance",
            and "moving_batches" (with `momentum=None`), "moving_stddev",
            "renorm_mean", "renorm_stddev" (with renorm), "num_updates"
            (with warm-up), "skipped_updates" (with `count_skipped`), the
            `ACCUMULATORS` (with `accumulation_steps`).
        mean: the batch's mean per feature (the statistics' shape).
        variance: its biased variance σ²_B, shaped like `mean`.
        count: the values behind each statistic: a scalar (a Python number
            when known before run time, which spares eager calls a few
            operations), or per feature.
        weight: the batch's weight w in the cumulative average.

    Returns:
        A dict with the keys of `state` and the new values.
    """
    if rule.accumulation_steps:
        return _after_accumulation(rule, state, mean, variance, count, weight)
    batch_variance = variance
    # A count known before run time (a Python number) takes Python
    # arithmetic where the result stays a number, sparing eager calls.
    static = isinstance(count, (int, float))
    if rule.unbiased_variance:
        # m/(m−1) for m > 1; a single value carries no spread to correct.
        if static:
            variance = variance * (count / (count - 1.0) if count > 1 else 1.0)
        else:
            variance = variance * ops.where(count > 1.0, count / ops.maximum(count - 1.0, 1.0), 1.0)
    # A feature with one value (m = 1) or none says nothing about its
    # variance: its statistics stay as they were.
    if static:
        # Python arithmetic, also for torch.compile's symbolic sizes (a SymBool is no tensor).
        has_values = moved = 1.0 if count > 1 else 0.0
    else:
        has_values = ops.cast(count > 1.0, mean.dtype)
        # Whether any feature moves; `ops.max` would break a `torch.compile` graph.
        moved = ops.cast(ops.any(count > 1.0), mean.dtype)
    new = {}
    if rule.momentum is None:
        batches = state["moving_batches"] + weight * moved
        rate = moments.over_count(weight * has_values, batches)
        new["moving_batches"] = batches
    elif rule.momentum_warmup:
        step = state["num_updates"]
        momentum = ops.minimum(rule.momentum, (1.0 + step) / (10.0 + step))
        rate = (1.0 - momentum) * has_values
        new["num_updates"] = step + moved
    else:
        rate = (1.0 - rule.momentum) * has_values

    def move(name, value, rate=rate):
        # s + (b − s)·rate: PyTorch's `lerp` (`_assign_on_torch`), exact where b = s.
        new[name] = state[name] + (value - state[name]) * rate

    move("moving_mean", mean)
    if rule.renorm_momentum is None:
        move("moving_variance", variance)
    else:
        move("moving_stddev", ops.sqrt(variance + rule.epsilon))
        new["moving_variance"] = ops.relu(ops.square(new["moving_stddev"]) - rule.epsilon)
        renorm_rate = (1.0 - rule.renorm_momentum) * has_values
        move("renorm_mean", mean, renorm_rate)
        move("renorm_stddev", ops.sqrt(batch_variance + rule.epsilon), renorm_rate)
    if not rule.skip_nonfinite:
        return new
    # One decision for the whole update: under synchronisation every replica
    # holds the same merged moments, so all copies skip alike.
    finite = ops.all(ops.isfinite(ops.concatenate([mean, variance])))
    kept = {name: ops.where(finite, value, state[name]) for name, value in new.items()}
    if rule.count_skipped:
        # An empty batch (a replica's empty share of the last one) is no skip.
        had_values = count > 0 if static else ops.any(count > 0.0)
        stuck = ops.logical_and(had_values, ops.logical_not(moved > 0.0))
        skipped = ops.logical_or(ops.logical_not(finite), stuck)
        kept["skipped_updates"] = state["skipped_updates"] + ops.cast(skipped, mean.dtype)
    return kept


def _after_accumulation(rule, state, mean, variance, count, weight):
    """The state after micro-batch t of k: accumulated, and at t = k also updated and reset.

    The k micro-batches pool as ghost batches of one step do: the mean of
    their means and the mean of their within-batch variances, each weighted
    by its count m_i (a feature's micro-batches of one value or none add
    nothing), and the count Σ m_i / k' over the k' micro-batches with values,
    for which m/(m−1) gives the pooled unbiased Σ M2_i / Σ (m_i − 1). The
    moving statistics then move once, as after one batch (`update`); the
    accumulators are always updated, whatever `skip_nonfinite` decides, so a
    non-finite micro-batch skips the update of its k.
    """
    dtype = mean.dtype
    count = ops.broadcast_to(ops.cast(count, dtype), ops.shape(mean))
    has_values = count > 1.0
    counted = ops.where(has_values, count, ops.zeros_like(count))
    total = state["accumulated_count"] + counted
    share = moments.over_count(counted, total)
    pooled_mean = state["accumulated_mean"] + (mean - state["accumulated_mean"]) * share
    pooled_variance = (
        state["accumulated_variance"] + (variance - state["accumulated_variance"]) * share
    )
    batches = state["accumulated_batches"] + ops.cast(has_values, dtype)
    steps = state["accumulated_steps"] + 1.0
    one_batch = dataclasses.replace(rule, accumulation_steps=None)
    new = update(
        one_batch, state, pooled_mean, pooled_variance, moments.over_count(total, batches), weight
    )
    done = steps >= rule.accumulation_steps
    out = {name: ops.where(done, value, state[name]) for name, value in new.items()}
    accumulated = (steps, batches, total, pooled_mean, pooled_variance)
    for name, value in zip(ACCUMULATORS, accumulated):
        out[name] = ops.where(done, ops.zeros_like(value), value)
    return out


def assign(rule, variables, mean, variance, count):
    """Moves a layer's state by one training batch: assigns `update`'s new values.

    `variables` maps the names of `update`'s state to `keras.Variable`s; the
    other arguments are `update`'s (the moments may carry their gradient:
    the state takes their values). On PyTorch the common rule (a float
    momentum; no renorm, warm-up or accumulation; a count above 1 known
    before run time) takes a handful of native torch operations
    (`_assign_on_torch`): there every `keras.ops` call pays Keras' eager
    dispatch, several times a small operation's own cost.
    """
    if _torch_rule(rule, count):
        _assign_on_torch(rule, variables, mean, variance, count)
        return
    # Values, not the moments' gradient: under `jax.grad` the state takes
    # concrete arrays, not the transformation's tracers.
    mean, variance = ops.stop_gradient(mean), ops.stop_gradient(variance)
    values = {name: v.value for name, v in variables.items()}
    for name, value in update(rule, values, mean, variance, count).items():
        variables[name].assign(value)


def _torch_rule(rule, count):
    """Whether `_assign_on_torch` computes `update` for this rule and count."""
    return (
        keras.backend.backend() == "torch"
        and rule.momentum is not None
        and rule.renorm_momentum is None
        and not rule.momentum_warmup
        and not rule.accumulation_steps
        and isinstance(count, (int, float))
        and count > 1
    )


def _assign_on_torch(rule, variables, mean, variance, count):
    """`update` for `_torch_rule`'s case, in native torch operations.

    The non-finite guard decides on the device (no host synchronisation): a
    non-finite batch's statistics are replaced by the moving ones, towards
    which `lerp` moves each by nothing. Outside a `keras.StatelessScope` the
    moving statistics' tensors move in place (`lerp_`), as `Variable.assign`
    itself writes them (`copy_`), without its per-call conversions and
    checks: a training step at (256, 100) took 32 µs less. In a scope, which
    collects the new values instead, they are assigned; so is the skip
    counter, which only `count_skipped_updates` keeps.
    """
    import torch

    names = ["moving_mean", "moving_variance"]
    old = [variables[name].value for name in names]
    rate = 1.0 - rule.momentum
    in_place = not _in_stateless_scope()
    with torch.no_grad():
        if rule.unbiased_variance:
            variance = variance * (count / (count - 1.0))
        batch = [mean, variance]
        if rule.skip_nonfinite:
            finite = torch.isfinite(torch.cat(batch)).all()
            batch = [torch.where(finite, b, s) for b, s in zip(batch, old)]
        if in_place:
            for state, value in zip(old, batch):
                state.lerp_(value, rate)
        else:
            for name, state, value in zip(names, old, batch):
                variables[name].assign(torch.lerp(state, value, rate))
        if rule.skip_nonfinite and rule.count_skipped:
            # A batch of more than one value per feature moves them all unless it is skipped.
            skipped = variables["skipped_updates"]
            skipped.assign(skipped.value + torch.logical_not(finite).to(skipped.value.dtype))


def _in_stateless_scope():
    """Whether a `keras.StatelessScope` collects the variables' new values (assumed if unknown)."""
    return _keras_query is None or _keras_query()


def recomputing():
    """Whether this forward call recomputes one for a backward pass (gradient checkpointing).

    PyTorch's checkpointing (`keras.RematScope`) runs a checkpointed region's
    forward again inside the backward pass, the enclosing model's included:
    the step's update of the moving statistics was made by the first run.
    PyTorch has no public flag for it; its checkpointing itself tells the
    recomputation by the autograd engine's current graph task, -1 outside a
    backward pass. On the other engines a recomputation updates no state
    (JAX's is functional, TensorFlow's RematScope does not run a `fit` step).
    Under `torch.compile` the call is traced once, not run again by Python:
    False there (the engine's task is no graph value).
    """
    if keras.backend.backend() != "torch":
        return False
    import torch

    if torch.compiler.is_compiling():
        return False
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1
