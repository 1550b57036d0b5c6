"""Creating a tf.distribute strategy from a name (see distribution_flags)."""

import tensorflow as tf


def create_strategy(name, tpu=None):
    """Returns the `tf.distribute.Strategy` called `name`.

    Create it before any dataset or model: datasets are then distributed by
    it and variables placed under its scope.

    Args:
        name: one of "off", "one_device", "mirrored", "multi_worker_mirrored",
            "tpu".
        tpu: the TPU name or address for "tpu" ("local" on a TPU VM).

    Raises:
        ValueError: for an unknown name or "tpu" without `tpu`.
    """
    if name == "off":
        return tf.distribute.get_strategy()
    if name == "one_device":
        gpus = tf.config.list_logical_devices("GPU")
        return tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0")
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    if name == "multi_worker_mirrored":
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "tpu":
        if not tpu:
            raise ValueError("The tpu strategy needs a TPU address. Received: tpu=None")
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
            tpu="" if tpu == "local" else tpu
        )
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    raise ValueError(
        "Unknown distribution strategy. Expected one of off, one_device, "
        f"mirrored, multi_worker_mirrored, tpu. Received: name={name!r}"
    )
