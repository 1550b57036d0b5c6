r"""Synchronised against per-rank statistics: a DDP training step over torch.distributed.

The conv net of `benchmarks/sync_speed.py` (`benchmarks/sync_models.py`:
conv → BN → ReLU, twice, pooling, a dense head) trains under
`torch.nn.parallel.DistributedDataParallel` on every rank of the process
group (gloo on CPUs), once with `keras_bn.BatchNormalization(synchronized=True)`
(each step's moments merged across the ranks) and once with
`synchronized=False` (each rank's own), and once more per rank on the
layer's general path (`fused=False`, the path the synchronised layer takes:
its moments and derivative in Keras ops), which parts the synchronised
step's extra time into the general path's and the collectives', the three
measured round-robin in the same processes. Rank 0 prints the median time
per step of each and the ratio of each to the per-rank step per paired
round, its median and quartiles.

Run (2 processes, `--per_rank_batch` examples each):
    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        -m benchmarks.torch_sync_speed --rounds=15
"""

import datetime
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

_BATCH = flags.DEFINE_integer("per_rank_batch", 32, "Examples per rank and step.", lower_bound=2)
_ROUNDS = flags.DEFINE_integer("rounds", 15, "Timed samples per candidate.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Steps per sample.", lower_bound=1)


def make_step(per_rank_batch, **layer_kwargs):
    """One DDP training step of the conv net, its batch fixed (this rank's own)."""
    import keras
    import numpy as np
    import torch
    import torch.distributed as dist

    from benchmarks import sync_models
    import keras_bn

    keras.utils.set_random_seed(0)
    model = sync_models.conv_net(lambda: keras_bn.BatchNormalization(**layer_kwargs))
    module = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rng = np.random.default_rng(dist.get_rank())
    x = torch.tensor(rng.normal(size=(per_rank_batch, 32, 32, 16)).astype("float32"))
    y = torch.tensor(rng.integers(0, 10, per_rank_batch))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        optimizer.zero_grad()
        loss = loss_fn(module(x, training=True), y)
        loss.backward()
        optimizer.step()

    return step


def main(argv):
    del argv
    import keras
    import numpy as np
    import torch
    import torch.distributed as dist

    from benchmarks import timing

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    steps = {}
    try:
        steps["synchronized"] = make_step(_BATCH.value, synchronized=True)
        steps["per_rank"] = make_step(_BATCH.value)
        steps["per_rank_general"] = make_step(_BATCH.value, fused=False)
        # Every rank runs the candidates in the same order: their collectives meet.
        samples = timing.time_rounds(steps, warmup=3, repeats=_REPEATS.value, rounds=_ROUNDS.value)
    finally:
        steps.clear()  # The DDP models go before their process group (see docs/distributed.md).
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print(
        f"torch {torch.__version__}, Keras {keras.__version__}, "
        f"{os.environ.get('WORLD_SIZE', '1')} gloo ranks, {_BATCH.value} examples per rank, "
        f"medians of {_ROUNDS.value} paired rounds"
    )
    local = np.asarray(samples["per_rank"])
    for name, times in samples.items():
        q1, ratio, q3 = np.percentile(np.asarray(times) / local, [25, 50, 75])
        print(
            f"{name:<17} {np.median(times) * 1e3:7.2f} ms/step, / per_rank {ratio:.3f} "
            f"[q1–q3 {q1:.3f}–{q3:.3f}]"
        )


if __name__ == "__main__":
    app.run(main)
