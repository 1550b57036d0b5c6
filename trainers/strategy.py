"""Creating a tf.distribute strategy from a name (see distribution_flags)."""

import tensorflow as tf


def create_strategy(name, tpu=None, num_cpu_devices=None):
    """Returns the `tf.distribute.Strategy` called `name`.

    Create it before any dataset or model: datasets are then distributed by
    it and variables placed under its scope.

    Args:
        name: one of "off", "one_device", "mirrored", "multi_worker_mirrored",
            "tpu".
        tpu: the TPU name or address for "tpu" ("local" on a TPU VM).
        num_cpu_devices: if set, first split the CPU into this many logical
            devices; "mirrored" then mirrors over them when there is no GPU.

    Raises:
        ValueError: for an unknown name or "tpu" without `tpu`.
    """
    if num_cpu_devices:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_cpu_devices
        )
    if name == "off":
        return tf.distribute.get_strategy()
    if name == "one_device":
        gpus = tf.config.list_logical_devices("GPU")
        return tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0")
    if name == "mirrored":
        if num_cpu_devices and not tf.config.list_logical_devices("GPU"):
            return tf.distribute.MirroredStrategy(
                [d.name for d in tf.config.list_logical_devices("CPU")]
            )
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
