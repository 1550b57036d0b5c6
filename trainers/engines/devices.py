"""Splitting one physical device into logical devices for multi-replica runs.

A machine without several accelerators can still run multi-replica code:
TensorFlow splits a physical CPU (or GPU) into logical devices, each of which
a `tf.distribute.MirroredStrategy` treats as a replica. Used by the trainers'
`--num_cpu_devices`/`--num_gpu_devices` (and by the tests).
"""

_GPU_MEMORY_LIMIT_MB = 16384


def split_device(device_type, num_devices, memory_limit_mb=_GPU_MEMORY_LIMIT_MB):
    """Splits the first physical `device_type` device into `num_devices` logical ones.

    Must run before TensorFlow initialises its devices. If that already
    happened and at least `num_devices` logical devices of the type exist, it
    is a no-op (so several callers in one process agree); otherwise it raises.

    Args:
        device_type: "CPU" or "GPU".
        num_devices: int >= 1, the logical devices wanted.
        memory_limit_mb: memory of each logical GPU (GPUs need a limit).

    Returns:
        The names of the logical devices of that type.

    Raises:
        ValueError: for an unknown type, a bad count, or no such device.
        RuntimeError: if TensorFlow was initialised with fewer devices.
    """
    import tensorflow as tf  # Local: the layer itself needs no TensorFlow.

    if device_type not in ("CPU", "GPU"):
        raise ValueError(f"Expected 'CPU' or 'GPU'. Received: device_type={device_type!r}")
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"Expected a positive int. Received: num_devices={num_devices!r}")
    physical = tf.config.list_physical_devices(device_type)
    if not physical:
        raise ValueError(
            f"This machine has no {device_type}. Received: device_type={device_type!r}"
        )
    limit = memory_limit_mb if device_type == "GPU" else None
    try:
        tf.config.set_logical_device_configuration(
            physical[0], [tf.config.LogicalDeviceConfiguration(memory_limit=limit)] * num_devices
        )
    except RuntimeError:
        available = len(tf.config.list_logical_devices(device_type))
        if available < num_devices:
            raise RuntimeError(
                f"{num_devices} logical {device_type}s are needed but TensorFlow was "
                f"initialised with {available}; split the device before any TensorFlow op runs."
            ) from None
    return [d.name for d in tf.config.list_logical_devices(device_type)]
