"""Whether a run has diverged: checked at each evaluation, before the step is checkpointed.

A run has diverged at an evaluation when its record holds a non-finite
number (the interval's mean train loss first, then the metrics in record
order), a trainable weight is not finite, or a keras_bn layer counting its
skipped updates (`count_skipped_updates=True`) skipped every update of the
interval: its batch statistics were never finite, so its moving statistics
stopped following training. The skeleton then records the divergence,
never checkpoints the non-finite state, and stops the run (or, with
`--on_divergence=continue`, trains on without checkpointing until the state
is finite again).
"""

import math

import numpy as np

from keras_bn import population

STOP = "stop"
CONTINUE = "continue"
CHOICES = (STOP, CONTINUE)


class Watch:
    """Checks a run's evaluations for divergence (see the module docstring).

    Args:
        model: the run's model, restored to its start step.
        host_values: the engine's `host_values(variables) -> [np.ndarray]`.
        step: the step the model is at (the run's start).
    """

    def __init__(self, model, host_values, step):
        self._model = model
        self._host_values = host_values
        self._step = step  # Of the skipped-update counts below.
        self._counted = [
            layer
            for layer in population.batch_norm_layers(model)
            if layer.skipped_updates is not None
        ]
        self._skipped = self._skipped_counts()

    def _skipped_counts(self):
        counters = [layer.skipped_updates for layer in self._counted]
        return [int(value) for value in self._host_values(counters)]

    def check(self, record, step):
        """The first sign of divergence in `record`, at `step`, or in the steps that led there.

        The skipped updates are counted since the previous check (or the
        run's start, which may be mid-interval for a resumed run).

        Returns:
            A short text naming the first non-finite quantity ("train_loss
            is nan", "weight dense/kernel is not finite", ...), or None.
        """
        skipped, self._skipped = self._skipped, self._skipped_counts()
        steps, self._step = step - self._step, step
        keys = sorted(record, key=lambda key: key != "train_loss")
        for key in keys:
            value = record[key]
            if isinstance(value, float) and not math.isfinite(value):
                return f"{key} is {value}"
        problem = self.weights_problem()
        if problem is not None:
            return problem
        for layer, before, after in zip(self._counted, skipped, self._skipped):
            if steps and after - before >= steps:
                return (
                    f"BN layer {layer.name} skipped all {steps} updates of its moving statistics "
                    "since the last evaluation (its batch statistics were not finite)"
                )
        return None

    def weights_problem(self):
        """ "weight <path> is not finite" for the first trainable weight that is not, or None."""
        variables = self._model.trainable_variables
        for variable, value in zip(variables, self._host_values(variables)):
            if not np.isfinite(value).all():
                return f"weight {variable.path} is not finite"
        return None
