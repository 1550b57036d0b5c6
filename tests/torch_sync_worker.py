"""One rank of keras_bn's synchronised moments under torch.distributed, started by torchrun.

    python -m torch.distributed.run --standalone --nproc_per_node=4 -m tests.torch_sync_worker

Each case splits one global batch over the ranks (in rank order), runs a
`synchronized=True` layer on this rank's rows with a loss of weighted output
sums, and compares with one `synchronized=False` layer on the whole batch in
this process: the output rows, the input gradient rows, γ's and β's gradients
summed over the ranks (as data parallelism sums them) and the moving
statistics. A `DistributedDataParallel` case trains a small model a few SGD
steps against one process on the global batch. Each rank writes one JSON
line per case to `--out_dir/rank<r>.jsonl`: its largest error relative to
the largest reference value of each quantity. `--lose_rank` makes the last
rank exit mid-run instead, and the others report how their next call ended.
"""

import argparse
import datetime
import json
import os
import re
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import keras_bn  # noqa: E402

C = 3  # Features.


def _rows(world):
    """Each case's rows per rank: equal, unequal, one rank empty."""
    return {
        "equal": [4] * world,
        "unequal": [r + 1 for r in range(world)],
        "empty_rank": [0] + [3] * (world - 1),
    }


def _relative(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if want.size == 0:
        return 0.0
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


_OUT = []  # The file this rank reports to (`main`).


def _report(case, rank, errors):
    with open(_OUT[0], "a") as f:
        f.write(json.dumps({"case": case, "rank": rank, "errors": errors}) + "\n")


def _layer(**kwargs):
    layer = keras_bn.BatchNormalization(momentum=0.9, **kwargs)
    return layer


def _compare_layer(name, rows, rank, world, shape=(C,), mask=False, compiled=False, **kwargs):
    """Synchronised rows of rank `rank` against one layer on the whole batch.

    `compiled`: the synchronised call runs under `torch.compile`.
    """
    rng = np.random.default_rng(7)
    total = sum(rows)
    x = rng.normal(3.0, 2.0, (total, *shape)).astype("float32")
    weights = rng.normal(size=(total, *shape)).astype("float32")
    keep = (rng.random(total) > 0.3).astype("float32") if mask else None
    gamma = rng.normal(1.0, 0.2, (shape[-1],)).astype("float32")
    beta = rng.normal(0.0, 0.2, (shape[-1],)).astype("float32")
    start = sum(rows[:rank])
    rows_here = slice(start, start + rows[rank])
    breaks = []  # Graph breaks and graphs beyond one of a compiled call.

    def run(layer, x, weights, keep, compiled=False):
        layer.build((None, *shape))
        layer.gamma.assign(gamma)
        layer.beta.assign(beta)
        x = torch.tensor(x, requires_grad=True)
        m = None if keep is None else torch.tensor(keep > 0)
        call = lambda x, m: layer(x, training=True, mask=m)
        if compiled:
            # Traced whole, the all-reduce included: a graph break counts as an error. (On a
            # layer of its own: explaining runs the call, which moves the statistics.)
            probe = _layer(synchronized=True, **kwargs)
            probe.build((None, *shape))
            report = torch._dynamo.explain(lambda x, m: probe(x, training=True, mask=m))(x, m)
            breaks.append(len(report.break_reasons) + report.graph_count - 1)
            call = torch.compile(call)
        y = call(x, m)
        loss = torch.sum(y * torch.tensor(weights))
        loss.backward()
        grads = [layer.gamma.value.grad, layer.beta.value.grad]
        grads = [np.zeros(shape[-1], "float32") if g is None else g.numpy() for g in grads]
        stats = [np.asarray(layer.moving_mean.numpy()), np.asarray(layer.moving_variance.numpy())]
        return y.detach().numpy(), x.grad.numpy(), grads, stats

    sync = run(
        _layer(synchronized=True, **kwargs),
        x[rows_here],
        weights[rows_here],
        None if keep is None else keep[rows_here],
        compiled,
    )
    single_kwargs = {k: v for k, v in kwargs.items() if k != "sync_group_size"}
    if "sync_group_size" in kwargs:  # The reference of a group: its ranks' rows alone.
        size = kwargs["sync_group_size"]
        first = rank // size * size
        group = slice(sum(rows[:first]), sum(rows[: first + size]))
        x, weights = x[group], weights[group]
        keep = None if keep is None else keep[group]
        rows_here = slice(rows_here.start - group.start, rows_here.stop - group.start)
    reference = run(_layer(**single_kwargs), x, weights, keep)
    if "sync_group_size" in kwargs:
        # Every rank keeps the mean over the groups' moving statistics (as tf.distribute's
        # replicas' copies are read) of the groups that have values (two or more): the
        # mean over those ranks of their groups' references.
        has = 1.0 if group.stop - group.start > 1 else 0.0
        ranks_with_values = torch.tensor(has)
        dist.all_reduce(ranks_with_values)
        for i, value in enumerate(reference[3]):
            value = torch.tensor(value) * has
            dist.all_reduce(value)
            reference[3][i] = (value / ranks_with_values).numpy()
        # γ's and β's gradients add up over the groups: each group's reference, once.
        for i, value in enumerate(reference[2]):
            value = torch.tensor(value)
            dist.all_reduce(value)
            reference[2][i] = (value / kwargs["sync_group_size"]).numpy()
    # γ's and β's gradients: each rank's own sums, which data parallelism adds up.
    sums = [torch.tensor(g) for g in sync[2]]
    for g in sums:
        dist.all_reduce(g)
    errors = {
        "output": _relative(sync[0], reference[0][rows_here]),
        "input_gradient": _relative(sync[1], reference[1][rows_here]),
        "gamma_gradient": _relative(sums[0].numpy(), reference[2][0]),
        "beta_gradient": _relative(sums[1].numpy(), reference[2][1]),
        "moving_mean": _relative(sync[3][0], reference[3][0]),
        "moving_variance": _relative(sync[3][1], reference[3][1]),
    }
    if compiled:
        errors["graph_breaks"] = float(breaks[0])
    _report(name, rank, errors)


def _ddp(rank, world, steps=3):
    """A DDP model trained `steps` SGD steps against one process on the global batch."""
    rng = np.random.default_rng(3)
    per_rank = 6
    x = rng.normal(1.0, 2.0, (steps, per_rank * world, 5)).astype("float32")
    y = rng.normal(size=(steps, per_rank * world, 1)).astype("float32")

    def model(synchronized):
        keras.utils.set_random_seed(11)
        return keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(4, use_bias=False),
                keras_bn.BatchNormalization(synchronized=synchronized, momentum=0.9),
                keras.layers.ReLU(),
                keras.layers.Dense(1),
            ]
        )

    def train(net, rows, ddp):
        module = torch.nn.parallel.DistributedDataParallel(net) if ddp else net
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(steps):
            optimizer.zero_grad()
            out = module(torch.tensor(x[step][rows]), training=True)
            # The mean over this process's rows; DDP averages the ranks' gradients.
            loss = torch.mean((out - torch.tensor(y[step][rows])) ** 2)
            loss.backward()
            optimizer.step()
        return [np.asarray(v.numpy()) for v in net.weights]

    distributed = train(model(True), slice(rank * per_rank, (rank + 1) * per_rank), True)
    single = train(model(False), slice(None), False)
    errors = {f"weight_{i}": _relative(a, b) for i, (a, b) in enumerate(zip(distributed, single))}
    _report("ddp", rank, errors)


def _second_order(rank, world, rows=4):
    """A gradient penalty's gradient: γ's, summed over the ranks, against one process's."""
    rng = np.random.default_rng(13)
    x = rng.normal(1.0, 2.0, (world * rows, C)).astype("float32")
    w = rng.normal(size=(world * rows, C)).astype("float32")

    def gamma_gradient(layer, x, w):
        layer.build((None, C))
        x = torch.tensor(x, requires_grad=True)
        loss = torch.sum(layer(x, training=True) * torch.tensor(w))
        (dx,) = torch.autograd.grad(loss, x, create_graph=True)
        torch.sum(dx**2).backward()  # The penalty of each example's input gradient.
        return layer.gamma.value.grad.detach()

    mine = slice(rank * rows, (rank + 1) * rows)
    synced = gamma_gradient(_layer(synchronized=True), x[mine], w[mine])
    dist.all_reduce(synced)
    single = gamma_gradient(_layer(), x, w)
    _report("second_order", rank, {"gamma_gradient": _relative(synced.numpy(), single.numpy())})


def _unequal_virtual_batches(rank, world):
    """Ranks of other batch sizes with `virtual_batch_size`: every rank refuses, none hangs."""
    layer = _layer(synchronized=True, virtual_batch_size=2)
    try:
        layer(torch.ones((2 + 2 * rank, C)), training=True)
    except ValueError as error:
        refused = "must be the same on every rank" in str(error)
    else:
        refused = False
    _report("unequal_virtual_batches", rank, {"not_refused": 0.0 if refused else 1.0})


def _accumulation(rank, world, steps=2, rows=3):
    """`accumulation_steps`: one update from the pooled moments of `steps` micro-batches.

    Each micro-batch is normalised with the moments of every rank's rows of it; the moving
    statistics move once, from the micro-batches pooled, as one process's layer moves on the
    global micro-batches.
    """
    rng = np.random.default_rng(9)
    data = rng.normal(2.0, 3.0, (steps, world * rows, C)).astype("float32")
    synced = _layer(synchronized=True, accumulation_steps=steps)
    single = _layer(accumulation_steps=steps)
    errors = {}
    for step, batch in enumerate(data):
        mine = synced(torch.tensor(batch[rank * rows : (rank + 1) * rows]), training=True)
        whole = single(torch.tensor(batch), training=True)
        rows_here = whole.detach().numpy()[rank * rows : (rank + 1) * rows]
        errors[f"output_{step}"] = _relative(mine.detach().numpy(), rows_here)
    errors["moving_mean"] = _relative(synced.moving_mean.numpy(), single.moving_mean.numpy())
    errors["moving_variance"] = _relative(
        synced.moving_variance.numpy(), single.moving_variance.numpy()
    )
    _report("accumulation", rank, errors)


def _population(rank, world, synchronized, steps=3, rows=4):
    """`estimate_population_statistics` over every rank's batches against one process's."""
    rng = np.random.default_rng(5)
    data = (rng.normal(size=(steps, world * rows, 2, 2, C)) * [1.0, 2.0, 3.0] + 4.0).astype(
        "float32"
    )

    def model(synchronized):
        keras.utils.set_random_seed(5)
        layer = keras_bn.BatchNormalization(synchronized=synchronized, momentum=None)
        return keras.Sequential([keras.Input((2, 2, C)), layer]), layer

    mine = [batch[rank * rows : (rank + 1) * rows] for batch in data]
    ranked, layer = model(synchronized)
    keras_bn.estimate_population_statistics(ranked, mine, num_batches=steps)
    # One process's over the same batches: every rank's (the global ones when synchronised).
    # Every rank computes it alike, so the pooling over ranks leaves it as it is.
    batches = list(data)
    if not synchronized:
        batches = [b[r * rows : (r + 1) * rows] for b in data for r in range(world)]
    single, reference = model(False)
    keras_bn.estimate_population_statistics(single, batches, num_batches=len(batches))
    errors = {
        "moving_mean": _relative(layer.moving_mean.numpy(), reference.moving_mean.numpy()),
        "moving_variance": _relative(
            layer.moving_variance.numpy(), reference.moving_variance.numpy()
        ),
    }
    name = "population_synchronized" if synchronized else "population"
    _report(name, rank, errors)


def _lose_rank(rank, world):
    """The last rank exits after the first call; the others report how their next call ends."""
    layer = _layer(synchronized=True)
    x = torch.ones((4, C)) * (rank + 1)
    layer(x, training=True)
    if rank == world - 1:
        os._exit(3)
    began = time.monotonic()
    try:
        layer(x, training=True)
    except RuntimeError as error:
        # The layer's own line (Keras adds the call's arguments on lines of their own, and
        # terminal bold around the message).
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
        line = next(line for line in text.splitlines() if "keras_bn." in line)
        print(f"LOST after {time.monotonic() - began:.1f} s: {line}", flush=True)
        sys.exit(1)
    print("NOT LOST", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lose_rank", action="store_true")
    parser.add_argument("--out_dir", default=".")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    _OUT.append(os.path.join(args.out_dir, f"rank{rank}.jsonl"))
    try:
        if args.lose_rank:
            _lose_rank(rank, world)
            return
        for name, rows in _rows(world).items():
            _compare_layer(name, rows, rank, world)
        _compare_layer("mask", [4] * world, rank, world, mask=True)
        _compare_layer("conv", [2] * world, rank, world, shape=(3, 3, C))
        _compare_layer("compiled", [4] * world, rank, world, compiled=True)
        if world % 2 == 0:
            _compare_layer("groups", [4] * world, rank, world, sync_group_size=2)
            # Two ranks' rows of 2 examples each: each group of 2 ranks is one virtual batch.
            _compare_layer("virtual_groups", [2] * world, rank, world, virtual_batch_size=4)
        _compare_layer("ghost_batches", [4] * world, rank, world, virtual_batch_size=2)
        # Each rank's own batch, and ghost batches of it, with an empty rank: the moving
        # statistics still averaged over the ranks that have values, in one collective.
        _compare_layer("own_batch", [0] + [4] * (world - 1), rank, world, sync_group_size=1)
        _compare_layer("own_batch_virtual", [4] * world, rank, world, virtual_batch_size=4)
        _second_order(rank, world)
        _unequal_virtual_batches(rank, world)
        _ddp(rank, world)
        _accumulation(rank, world)
        _population(rank, world, synchronized=False)
        _population(rank, world, synchronized=True)
    finally:
        if not args.lose_rank:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
