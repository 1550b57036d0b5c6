"""Which process of a distributed run writes its files."""

import keras


def is_chief(strategy=None):
    """Whether this process writes a run's files (events, results, checkpoints).

    On JAX, process 0 of a multi-process `keras.distribution` job (every
    single-process run) writes. On TensorFlow only
    `tf.distribute.MultiWorkerMirroredStrategy` has more than one process:
    there the chief is the "chief" task, or worker 0 when the cluster has no
    chief (TF_CONFIG conventions); every other strategy, and no strategy,
    runs in one process, which writes. Other backends run in one process.

    Args:
        strategy: a `tf.distribute.Strategy` (TensorFlow backend), default
            the current one.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.process_index() == 0
    if backend != "tensorflow":
        return True
    import tensorflow as tf  # Only tf.distribute runs have several workers.

    strategy = strategy or tf.distribute.get_strategy()
    resolver = strategy.cluster_resolver
    if resolver is None or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return True
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type in (None, "chief"):
        return True
    return (
        task_type == "worker" and task_id == 0 and "chief" not in resolver.cluster_spec().as_dict()
    )
