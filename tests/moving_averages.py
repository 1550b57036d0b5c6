"""A layer's moving statistics after many equal training steps, for tests and benchmarks."""

import keras
import numpy as np


def moving_mean_after(layer, x, steps):
    """`layer`'s moving mean (per feature, float64) after `steps` training steps on `x`.

    One `fit` of `steps` batches, each `x`, with learning rate 0: γ and β
    stay, only the moving statistics move.
    """
    model = keras.Sequential([keras.Input(x.shape[1:]), layer])
    model.compile(keras.optimizers.SGD(0.0), "mse")
    batches = np.tile(x, (steps, 1))
    model.fit(batches, np.zeros_like(batches), batch_size=len(x), shuffle=False, verbose=0)
    return np.asarray(keras.ops.convert_to_numpy(layer.moving_mean), np.float64)
