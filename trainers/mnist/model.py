"""The paper's MNIST network (§4.1): 784-100-100-100-10, sigmoid hidden units.

Only Keras and keras_bn, no TensorFlow: it builds on every Keras backend
(`benchmarks/jax_data_parallel.py` trains it under JAX).
"""

import keras

import keras_bn

RUN_NAMES = {"none": "baseline", "batch_norm": "batch_norm"}
HIDDEN_UNITS = (100, 100, 100)
NUM_CLASSES = 10


def build_model(
    norm,
    init_std,
    seed,
    sync_batch_norm=False,
    sync_group_size=None,
    batch_norm_layer=keras_bn.BatchNormalization,
    momentum_warmup=False,
):
    """Returns `(model, probe)`: the classifier and its pre-activation outputs.

    The baseline computes y = sigmoid(Wu + b); the BN network
    y = sigmoid(BN(Wu)) (β replaces the bias). `model` maps 784 inputs to 10
    logits; `probe` maps them to the inputs of the three sigmoid layers (the
    pre-activations).

    Args:
        norm: "none" or "batch_norm".
        init_std: std of the Gaussian kernel initialisation.
        seed: the kernels' seed (layer i uses seed + i, the logits seed).
        sync_batch_norm: the BN layers synchronise their moments across
            replicas (keras_bn layers only).
        sync_group_size: with `sync_batch_norm`, replicas per group.
        batch_norm_layer: the BN layer class, default
            `keras_bn.BatchNormalization`; `keras.layers.BatchNormalization`
            for comparisons (then without the sync arguments).
        momentum_warmup: the BN layers warm their momentum up (keras_bn
            layers only; `keras_bn.BatchNormalization(momentum_warmup=True)`).
    """
    initializer = lambda i: keras.initializers.RandomNormal(stddev=init_std, seed=seed + i)
    if batch_norm_layer is keras_bn.BatchNormalization:
        bn_kwargs = {
            "synchronized": sync_batch_norm,
            "sync_group_size": sync_group_size,
            "momentum_warmup": momentum_warmup,
            # The run's TensorBoard shows each layer's skipped updates.
            "count_skipped_updates": True,
        }
    elif sync_batch_norm or sync_group_size is not None or momentum_warmup:
        raise ValueError(
            "Only keras_bn layers take the sync and warm-up arguments here. "
            f"Received: batch_norm_layer={batch_norm_layer.__name__}, "
            f"sync_batch_norm={sync_batch_norm}"
        )
    else:
        bn_kwargs = {}
    inputs = keras.Input((784,), name="image")
    h = inputs
    pre_activations = []
    for i, units in enumerate(HIDDEN_UNITS, start=1):
        h = keras.layers.Dense(
            units, use_bias=norm == "none", kernel_initializer=initializer(i), name=f"dense_{i}"
        )(h)
        if norm == "batch_norm":
            h = batch_norm_layer(name=f"bn_{i}", **bn_kwargs)(h)
        pre_activations.append(h)
        h = keras.layers.Activation("sigmoid", name=f"sigmoid_{i}")(h)
    logits = keras.layers.Dense(NUM_CLASSES, kernel_initializer=initializer(0), name="logits")(h)
    model = keras.Model(inputs, logits, name=f"mnist_{RUN_NAMES[norm]}")
    return model, keras.Model(inputs, pre_activations, name="probe")
