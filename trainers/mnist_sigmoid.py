r"""Sigmoid MNIST network with and without Batch Normalization (paper §4.1, Fig. 1).

A 784-100-100-100-10 network with sigmoid hidden units, trained with plain
SGD on mini-batches of 60 for 50,000 steps. The baseline computes
y = sigmoid(Wu + b); the BN network y = sigmoid(BN(Wu)) with
keras_bn.BatchNormalization (β replaces the bias). Every --eval_every steps it
logs the test accuracy over the full 10k test set (inference mode), the
15th/50th/85th percentiles of the input to one sigmoid of the last hidden layer
over a fixed probe batch (Fig. 1 b, c), histograms of every hidden layer's
pre-activations, the train loss, the learning rate and the BN layers' health
(keras_bn.BatchNormMonitor) to TensorBoard under --model_dir/<network>
(--model_dir/<network>/seed_<s> with --num_seeds > 1), and checkpoints; a
killed run resumes from its last checkpoint with the same --model_dir. The
model_dir root holds the custom-scalars layout (Figure 1 as charts), the
HParams experiment and, at the end, the Figure 1 image; figure1.png (mean
and min–max band over seeds) and summary.json are written there too
(trainers/mnist/report.py).

--eval_bn_statistics=precise evaluates the BN network with statistics
re-estimated before each evaluation on its first --precise_bn_batches
training batches (trainers/run/skeleton.py); test_accuracy and the percentiles
are then theirs, the record keeps the moving statistics' as moving_* and the
estimation's wall time as precise_bn_seconds, TensorBoard logs
eval/moving_test_accuracy and eval/precise_bn_seconds beside
eval/test_accuracy, and the checkpoints keep the moving statistics.

Run (both networks, same seed and data order; without --data_dir TFDS
downloads MNIST):

    python -m trainers.mnist_sigmoid --data_dir=/path/to/tensorflow_datasets \
        --model_dir=runs/mnist

Expected result: the BN network reaches a higher test accuracy sooner and
ends higher than the baseline (98.08% vs 97.78% after 50,000 steps; 90.45%
vs 82.75% after 500; measured 2026, 2-core AMD EPYC CPU, TensorFlow 2.21.0,
Keras 3.15.1; see docs/reproduction.md), and its sigmoid-input percentiles
stay stable while the baseline's drift, as in the paper's Figure 1.

Learning-rate sweep (--lr_sweep, one seed; trainers/reporting/lr_sweep.py): each
network of --norm at --learning_rate × each multiplier, in
--model_dir/<network>/lr_x<m>; lr_sweep.json, lr_sweep.md and lr_sweep.png
at the root give each run's final and best accuracy and final train loss,
which runs diverged, and each network's best and largest stable rate (no
figure1.png or summary.json then):

    python -m trainers.mnist_sigmoid --lr_sweep=1,5,30,100 --train_steps=5000 \
        --data_dir=/path/to/tensorflow_datasets --model_dir=runs/mnist_lr_sweep
"""

# Run as a program, a SIGTERM or Ctrl-C during the imports below (seconds) asks the run to stop
# once it has started, as at any later point (trainers/run/preemption.py).
if __name__ == "__main__":
    from trainers.run import preemption

    preemption.defer_from_start()

import dataclasses
import os

from absl import app
from absl import flags

from flags import batch_norm_flags as batch_norm_flags
from flags import distribution_flags as distribution_flags
from flags import mnist_flags as mnist_flags
from flags import run_flags as run_flags
from flags import training_flags as training_flags
from trainers.engines import strategy as strategy_lib
from trainers.mnist import data as mnist_data
from trainers.mnist import model as mnist_model
from trainers.mnist import report as mnist_report
from trainers.mnist import task as mnist_task
from trainers.reporting import lr_sweep
from trainers.run import program
from trainers.run import run_config
from trainers.run import skeleton

# --help lists this trainer's own flags first.
flags.adopt_module_key_flags(mnist_flags)

TRAINER = "trainers.mnist_sigmoid"  # Recorded in --model_dir (see trainers/run/model_dirs.py).
RUN_NAMES = mnist_model.RUN_NAMES


@dataclasses.dataclass(frozen=True)
class Config(strategy_lib.DistributionConfig):
    """Everything one invocation runs with: every flag's value.

    Made once in `main` from the flags and logged whole (TensorBoard text
    "config" of each run, and `summary.json`), so no flag can go unrecorded.
    The fields declared `run_config.identity_field()` are a run's identity:
    what a resumed run must share with its checkpoint, and its HParams.
    """

    model_dir: str
    data_dir: str | None
    seed: int = run_config.identity_field()
    train_steps: int
    batch_size: int = run_config.identity_field(changeable=True)
    learning_rate: float = run_config.identity_field(changeable=True)
    eval_every: int
    norm: str = run_config.identity_field()
    init_std: float = run_config.identity_field()
    probe_size: int
    num_seeds: int
    lr_sweep: tuple | None
    # Not a flag: the multiplier of one run of a sweep (`sweep_config`), None outside one.
    lr_multiplier: float | None = dataclasses.field(default=None, kw_only=True)
    train_subset: int | None = run_config.identity_field()
    bn_momentum_warmup: bool = run_config.identity_field()
    allow_config_change: bool
    deterministic: bool
    eval_bn_statistics: str
    precise_bn_batches: int
    on_divergence: str

    @property
    def networks(self):
        """The networks to train, as `norm` values."""
        return ["none", "batch_norm"] if self.norm == "both" else [self.norm]

    @property
    def seeds(self):
        return run_flags.seeds(self.seed, self.num_seeds)

    def run_dir(self, norm, seed):
        """`model_dir/<network>`, or `model_dir/<network>/seed_<seed>` with several seeds.

        In a learning-rate sweep (`lr_multiplier` set): `model_dir/<network>/lr_x<m>`.
        """
        if self.lr_multiplier is not None:
            return lr_sweep.run_dir(self.model_dir, RUN_NAMES[norm], self.lr_multiplier)
        network_dir = os.path.join(self.model_dir, RUN_NAMES[norm])
        return run_flags.seed_dir(network_dir, seed, self.num_seeds)

    def loop(self, norm, seed):
        """The `skeleton.LoopConfig` of the run of network `norm` with `seed`."""
        return skeleton.LoopConfig.of(
            self,
            name=f"{RUN_NAMES[norm]} seed {seed}",
            run_dir=self.run_dir(norm, seed),
            seed=seed,
            steps_per_execution=None,
            max_to_keep=2,
        )


def config_from_flags():
    """The `Config` of the parsed flags (called by `main` only)."""
    holders = [
        run_flags.MODEL_DIR,
        run_flags.DATA_DIR,
        run_flags.SEED,
        training_flags.TRAIN_STEPS,
        training_flags.BATCH_SIZE,
        training_flags.LEARNING_RATE,
        training_flags.EVAL_EVERY,
        mnist_flags.NORM,
        mnist_flags.INIT_STD,
        mnist_flags.PROBE_SIZE,
        run_flags.NUM_SEEDS,
        training_flags.LR_SWEEP,
        mnist_flags.TRAIN_SUBSET,
        run_flags.ALLOW_CONFIG_CHANGE,
        run_flags.DETERMINISTIC,
        training_flags.EVAL_BN_STATISTICS,
        training_flags.PRECISE_BN_BATCHES,
        training_flags.ON_DIVERGENCE,
        *batch_norm_flags.HOLDERS,
        *distribution_flags.HOLDERS,
    ]
    values = training_flags.values_with_defaults(holders, mnist_flags.TRAINING_DEFAULTS)
    return Config(**{**values, "lr_sweep": training_flags.lr_multipliers()})


def sweep_config(config, multiplier):
    """The config of one run of --lr_sweep: --learning_rate × `multiplier`, its own directory."""
    return dataclasses.replace(
        config, learning_rate=config.learning_rate * multiplier, lr_multiplier=multiplier
    )


def run_sweep(config, runner, data):
    """--lr_sweep: every network at each multiple of --learning_rate (`lr_sweep`)."""
    norms = {RUN_NAMES[norm]: norm for norm in config.networks}

    def train_one(network, multiplier):
        one = sweep_config(config, multiplier)
        task = mnist_task.MnistRun(one, norms[network], config.seed, *data)
        return skeleton.train_and_evaluate(task, one.loop(norms[network], config.seed), runner)

    sweep = lr_sweep.Sweep(
        model_dir=config.model_dir,
        networks=tuple(norms),
        multipliers=config.lr_sweep,
        base_learning_rates={network: config.learning_rate for network in norms},
        num_classes=mnist_model.NUM_CLASSES,
        accuracy_key="test_accuracy",
        config=dataclasses.asdict(config),
    )
    lr_sweep.run(sweep, train_one, writes=runner.is_chief)


def main(argv):
    program.run("mnist_sigmoid", TRAINER, argv, config_from_flags, train_runs)


def train_runs(config):
    """Trains the runs `config` asks for; returns their histories by name (None for a sweep)."""
    # The runner comes first: datasets and variables are created under it,
    # and a multi-worker strategy must start before TensorFlow's runtime,
    # which the data checks (reading the shards) start.
    runner = config.create_runner()
    mnist_data.check_prepared(config.data_dir, config.batch_size, config.train_subset)
    program.claim(config, TRAINER, config.loop(config.networks[0], config.seed), runner)
    train, test = mnist_task.load_data(config)
    if runner.is_chief:
        networks = [RUN_NAMES[n] for n in config.networks]
        mnist_report.write_dashboards(config.model_dir, networks, Config.identity_names())
    if config.lr_sweep:
        run_sweep(config, runner, (train, test))
        return None
    runs = {RUN_NAMES[norm]: [] for norm in config.networks}
    for seed in config.seeds:  # Both networks of a seed, then the next seed.
        for norm in config.networks:
            task = mnist_task.MnistRun(config, norm, seed, train, test)
            history = skeleton.train_and_evaluate(task, config.loop(norm, seed), runner)
            runs[RUN_NAMES[norm]].append(history)
    if runner.is_chief:  # Only the chief writes the run's results.
        mnist_task.write_results(config, runs)
    return {
        f"{network} seed {seed}": history
        for network, histories in runs.items()
        for seed, history in zip(config.seeds, histories)
    }


if __name__ == "__main__":
    training_flags.set_defaults(**mnist_flags.TRAINING_DEFAULTS)  # Shown by --help; not at import.
    app.run(main)
