"""Batch Normalization flags shared by the trainers: options of every keras_bn layer they build."""

from absl import flags

BN_MOMENTUM_WARMUP = flags.DEFINE_bool(
    "bn_momentum_warmup",
    False,
    "Warm up the moving statistics' momentum as TensorFlow's EMA does: update t uses "
    "min(momentum, (1 + t) / (10 + t)), so early moving statistics follow the first "
    "batches instead of their initial values (keras_bn.BatchNormalization(momentum_warmup=True)).",
)

# Every BN flag, for the trainers' configs.
HOLDERS = (BN_MOMENTUM_WARMUP,)
