"""keras-bn: Batch Normalization (Ioffe & Szegedy, 2015) for Keras 3."""

from keras_bn.batch_normalization import BatchNormalization
from keras_bn.conversion import convert_batch_norm
from keras_bn.folding import fold_batch_norm
from keras_bn.folding import folding_plan
from keras_bn.monitor import BatchNormMonitor
from keras_bn.population import estimate_population_statistics

__version__ = "0.1.0"

__all__ = [
    "BatchNormMonitor",
    "BatchNormalization",
    "convert_batch_norm",
    "estimate_population_statistics",
    "fold_batch_norm",
    "folding_plan",
]
