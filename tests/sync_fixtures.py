"""Replica set-ups shared by the synchronisation tests and benchmarks."""

import functools
from unittest import mock


def split_cpu(num_devices):
    """Splits the CPU into `num_devices` logical devices, before TensorFlow starts them.

    Several callers in one process agree: once TensorFlow has started, a
    split into at least as many devices is kept, and fewer raise
    TensorFlow's `RuntimeError`.
    """
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices
        )
    except RuntimeError:
        if len(tf.config.list_logical_devices("CPU")) < num_devices:
            raise


@functools.cache
def mirrored_cpu_strategy(num_replicas):
    """One `MirroredStrategy` over logical CPUs 0..num_replicas-1 per process.

    Collective all-reduce keys are process-global: a second collective
    strategy restarts at group key 1 and the runtime rejects it ("joining a
    group with size 4, but that group has size 2"), which fails every later
    test of the process. So only the 4-replica strategy uses collective ops
    (CPU's default); the others reduce through one device, MirroredStrategy's
    other supported mode. The caller splits the CPU first (`split_cpu`).
    """
    import tensorflow as tf  # Local: the references serve the JAX tests too.

    devices = [f"/cpu:{i}" for i in range(num_replicas)]
    if num_replicas == 4:
        return tf.distribute.MirroredStrategy(devices)
    return tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


class CountingReplicaContext:
    """A stand-in replica context that counts its all-reduces and their floats.

    It plays replica `replica_id` of `num_replicas` whose peers hold no data:
    its all-reduce returns its input, which is exactly the SUM all-reduce when
    every other replica contributes zeros (an empty batch). Results must then
    equal local statistics. TensorFlow cannot XLA-compile MirroredStrategy
    collectives on logical CPU devices ("Trying to access resource ... located
    in device CPU:1 from device CPU:0"), so the XLA tests of the synchronised
    path run with this context, and `benchmarks.sync_speed --payload` counts
    the layer's traffic with it at replica counts no machine here has.

    Attributes:
        floats: the element count of each all-reduce, in call order.
    """

    def __init__(self, num_replicas, replica_id=0):
        self.num_replicas_in_sync = num_replicas
        self.replica_id_in_sync_group = replica_id
        self.floats = []

    def all_reduce(self, reduce_op, value):
        if str(reduce_op).upper() not in ("SUM", "REDUCEOP.SUM"):
            raise ValueError(f"Only SUM is counted. Received: reduce_op={reduce_op}")
        size = 1
        for dim in value.shape:
            size *= int(dim)
        self.floats.append(size)
        return value


def engine_context(context):
    """Runs training calls in `context`, as Keras' tests patch a distribution.

    Patches `batch_plan.current_context`, the one place a layer looks up
    where it runs; use as a `with` block.
    """
    from keras_bn import batch_plan

    return mock.patch.object(batch_plan, "current_context", return_value=context)


def count_all_reduces(layer, x, num_replicas):
    """Counts one training call's all-reduce floats, forward and backward.

    Runs the layer in training mode and the gradient with respect to `x`
    with a `CountingReplicaContext` playing replica 0 of `num_replicas` as
    its engine context (`engine_context` patches the lookup).

    Returns:
        `(forward, backward)`: the element counts of each all-reduce.
    """
    import tensorflow as tf  # The synchronised path is TensorFlow's.

    from keras_bn import batch_plan

    x = tf.convert_to_tensor(x)
    context = CountingReplicaContext(num_replicas)
    if not layer.built:
        layer.build(x.shape)
    with tf.GradientTape() as tape:
        tape.watch(x)
        with engine_context(batch_plan.EngineContext(replica_context=context)):
            y = layer(x, training=True)
    forward = list(context.floats)
    tape.gradient(y, x)
    return forward, context.floats[len(forward) :]
