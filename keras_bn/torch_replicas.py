"""The ranks of a `torch.distributed` process group, as synchronised moments see them.

On the PyTorch backend each rank of the default process group (started by
`torch.distributed.run`, or any `init_process_group`) is one replica with
a batch of its own, as a replica of `tf.distribute` is. `TorchReplicas` is
what `moments.ReplicaGroups` needs of a replica context: the replica count
and this rank's place, and a SUM all-reduce. The all-reduce is an autograd
function whose gradient is the all-reduce of the gradients, itself
differentiable, so the layer's derivatives of every order follow the merge
as they do on TensorFlow. Replica groups are
process groups of consecutive ranks (`torch.distributed.new_group`), made
once per group size and shared by every layer: a group's merge is one
all-reduce within it, of the size of the statistics.

Every rank must call a synchronised layer at the same points with the same
arguments (as every rank of a `DistributedDataParallel` model does): its
all-reduces are collectives, which a rank that skips one leaves waiting.
"""

# Process groups of consecutive ranks, by group size: every rank makes every
# group, in one order (`torch.distributed.new_group` is a collective).
_GROUPS = {}
# The autograd function of the sum (`_sum_function`), made at its first use.
_SUM = []


def current():
    """The default process group's ranks, or `None` without one or with one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    return None if world == 1 else TorchReplicas(None, world, dist.get_rank())


class TorchReplicas:
    """Ranks of a process group as replicas: `num_replicas_in_sync`, this rank's id, a sum.

    Args:
        group: the `torch.distributed` process group, `None` for the default one.
        size: its ranks.
        rank: this process's rank within it.
    """

    def __init__(self, group, size, rank):
        self._group = group
        self.num_replicas_in_sync = size
        self.replica_id_in_sync_group = rank

    def all_reduce(self, op, value):
        """The sum of `value` over the group's ranks (`op` is "SUM"), differentiable.

        Raises:
            RuntimeError: in one line, when the collective fails (a rank of
                the group is gone), with the backend's words.
        """
        if op != "SUM":
            raise ValueError(f"Only SUM all-reduces merge moments. Received: op={op!r}")
        try:
            return _sum_function().apply(value, self._group)
        except RuntimeError as error:  # gloo's or NCCL's: a rank gone, a connection reset.
            words = " ".join(str(error).split())[:300]
            raise RuntimeError(
                f"keras_bn.BatchNormalization(synchronized=True): the all-reduce of the moments "
                f"across {self.num_replicas_in_sync} ranks failed on rank "
                f"{self.replica_id_in_sync_group}, as when a rank is lost ({words})"
            ) from None

    def check_same(self, name, value):
        """Raises `ValueError` on every rank unless every rank passed the same int `value`."""
        import torch
        import torch.distributed as dist

        extremes = torch.tensor([value, -value], dtype=torch.int64, device=_device())
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self._group)
        high, low = int(extremes[0]), -int(extremes[1])
        if high != low:
            raise ValueError(
                f"With synchronized=True and virtual_batch_size, {name} must be the same on "
                f"every rank: it is between {low} and {high}. Received: {name}={value} on rank "
                f"{self.replica_id_in_sync_group}"
            )

    def group(self, size):
        """The replicas of this rank's group of `size` consecutive ranks (`size` divides them)."""
        import torch.distributed as dist

        # Made for this default group: a new `init_process_group` gets its own.
        key = (dist.group.WORLD, size)
        groups = _GROUPS.get(key)
        if groups is None:
            world = self.num_replicas_in_sync
            groups = [dist.new_group(list(range(g, g + size))) for g in range(0, world, size)]
            _GROUPS[key] = groups
        rank = self.replica_id_in_sync_group
        return TorchReplicas(groups[rank // size], size, rank % size)


def sum_over_ranks(values):
    """The sum over the default process group's ranks of `values` (a float64 NumPy array)."""
    import torch
    import torch.distributed as dist

    total = torch.as_tensor(values, dtype=torch.float64).to(_device())
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.cpu().numpy()


def _device():
    """Where the default group's collectives take tensors: NCCL's on this rank's GPU."""
    import torch
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sum_function():
    """The differentiable all-reduce sum: an autograd function, its gradient itself."""
    if not _SUM:
        import torch
        import torch.distributed as dist

        class AllReduceSum(torch.autograd.Function):
            @staticmethod
            def forward(ctx, value, group):
                ctx.group = group
                total = value.contiguous().clone()
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
                return total

            @staticmethod
            def backward(ctx, gradient):
                # Every rank's output is the sum of every rank's input.
                return AllReduceSum.apply(gradient.contiguous(), ctx.group), None

        _SUM.append(AllReduceSum)
    return _SUM[0]
