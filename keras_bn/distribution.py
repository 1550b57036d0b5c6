"""Which process of a distributed run writes its files."""


def is_chief(strategy=None):
    """Whether this process writes a run's files (events, results, checkpoints).

    Only `tf.distribute.MultiWorkerMirroredStrategy` has more than one
    process: there the chief is the "chief" task, or worker 0 when the cluster
    has no chief (TF_CONFIG conventions). Every other strategy, and no
    strategy, runs in one process, which writes.

    Args:
        strategy: a `tf.distribute.Strategy`, default the current one.
    """
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
