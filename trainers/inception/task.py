"""The BN-Inception trainer's task: its model, data, evaluation, summaries and summary.json.

`trainers/inception_bn.py` turns the flags into a `Config` and runs
`InceptionRun` for each variant through the shared loop (`trainers.run.skeleton`).
"""

import os

import keras
import tensorflow as tf

from trainers.inception import data as image_data
from trainers.inception import model as inception_model
from trainers.inception import recipes as inception_recipes
from trainers.inception import table2 as inception_table2
from trainers.reporting import tensorboard_writers
from trainers.run import data_checks
from trainers.run import json_files
from trainers.run import skeleton

# With --eval_bn_statistics=precise, in each run: the two statistics' accuracies in one chart.
PRECISE_CHARTS = {
    "top-1, precise and moving BN statistics": [r"^eval/(moving_)?top1$"],
    "top-5, precise and moving BN statistics": [r"^eval/(moving_)?top5$"],
}


def build_model(
    recipe,
    *,
    image_size,
    sync_batch_norm,
    sync_group_size=None,
    num_classes=image_data.NUM_CLASSES,
    momentum_warmup=False,
    width_multiplier=1.0,
):
    return inception_model.build_inception(
        image_size=image_size,
        num_classes=num_classes,
        batch_norm=recipe.batch_norm,
        activation=recipe.activation,
        lrn=recipe.lrn,
        dropout=recipe.dropout,
        weight_decay=recipe.weight_decay,
        sync_batch_norm=sync_batch_norm,
        sync_group_size=sync_group_size,
        momentum_warmup=momentum_warmup,
        width_multiplier=width_multiplier,
    )


def make_replica_eval(model):
    """`(x, y) -> [top-1 hits, top-5 hits, examples]` of one replica's batch, in Keras ops.

    Single-crop accuracy in inference mode; compiled by the runner
    (`runner.compile`) and summed over replicas and batches by it.
    """

    def replica_eval(x, y):
        logits = model(x, training=False)
        y = keras.ops.cast(y, "int32")
        top1 = keras.ops.sum(keras.ops.cast(keras.ops.in_top_k(y, logits, 1), "float32"))
        top5 = keras.ops.sum(keras.ops.cast(keras.ops.in_top_k(y, logits, 5), "float32"))
        examples = keras.ops.cast(keras.ops.shape(y)[0], "float32")
        return keras.ops.stack([top1, top5, examples])

    return replica_eval


def steps_to_target(evals, target_accuracy):
    """The first evaluated step whose top-1 reached the target, else None."""
    return inception_table2.first_step_reaching(evals, target_accuracy)


class InceptionRun(skeleton.Task):
    """One variant trained on `spec`'s data set (or fake data) and evaluated on its eval split.

    The step at which top-1 first reaches `config.target_accuracy` is derived
    from the kept evaluation records, so a resumed run never keeps one from
    evaluations after its checkpoint. With BN, `keras_bn.BatchNormMonitor`
    logs the layers' health on a fixed evaluation batch, aggregated per
    stage: worst and median train/inference gap, per-stage weight histograms.
    """

    def __init__(self, config, spec=image_data.IMAGENET_SPEC):
        self.config, self.recipe, self.spec = config, config.recipe, spec

    def _dataset(self, split, seed, start_step=0):
        config = self.config
        return image_data.make_dataset(
            spec=self.spec,
            split=split,
            data_dir=config.data_dir,
            batch_size=config.batch_size,
            seed=seed,
            image_size=config.image_size,
            distortion=self.recipe.distortion,
            thorough_shuffle=self.recipe.thorough_shuffle,
            use_fake_data=config.use_fake_data,
            start_step=start_step,
        )

    def build(self):
        recipe, config = self.recipe, self.config
        self.model = build_model(
            recipe,
            image_size=config.image_size,
            sync_batch_norm=config.sync_batch_norm,
            sync_group_size=config.sync_group_size,
            momentum_warmup=config.bn_momentum_warmup,
            num_classes=self.spec.num_classes,
            width_multiplier=config.width_multiplier,
        )
        self.schedule = keras.optimizers.schedules.ExponentialDecay(
            recipe.learning_rate, recipe.decay_steps, inception_recipes.DECAY_RATE, staircase=True
        )
        optimizer = keras.optimizers.SGD(self.schedule, momentum=inception_recipes.MOMENTUM)
        return self.model, optimizer

    def prepare_evaluation(self, model, runner):
        self.runner = runner
        self.eval_data = self._dataset(self.spec.eval_split, self.config.seed)
        self.replica_eval = runner.compile(make_replica_eval(model), model)
        self.monitor = None
        if self.recipe.batch_norm:
            probe_images = next(iter(self.eval_data))[0].numpy()
            self.monitor = tensorboard_writers.make_monitor(
                model, probe_images, group_by=inception_model.bn_stage
            )

    def write_start(self, writer):
        if self.config.eval_bn_statistics == "precise":
            tensorboard_writers.write_custom_scalars(
                writer, "Precise BN statistics", PRECISE_CHARTS
            )

    def data_identity(self):
        if self.config.use_fake_data:
            return None  # Fake data: `use_fake_data` and the shapes identify it.
        return data_checks.fingerprint(self.config.data_dir, self.spec.name)

    def train_dataset(self, start_step):
        # The batches (order and distortions) are a function of (seed, step),
        # so a resumed run trains on those an uninterrupted run would.
        return self._dataset("train", self.config.seed, start_step)

    def evaluate(self, step, interval):
        hits = self.runner.sum_over_batches(
            self.replica_eval, self.eval_data, self.config.eval_steps
        )
        return {
            "step": step,
            "train_loss": interval["train_loss"],
            "top1": float(hits[0] / hits[2]),
            "top5": float(hits[1] / hits[2]),
            "learning_rate": float(self.schedule(step - 1)),
            "images_per_sec": self.config.batch_size * interval["steps"] / interval["seconds"],
        }

    def statistics_metrics(self):
        return ("top1", "top5")

    def write_summaries(self, record, history):
        tf.summary.scalar("train/loss", record["train_loss"])
        tf.summary.scalar("train/learning_rate", record["learning_rate"])
        tf.summary.scalar("eval/top1", record["top1"])
        tf.summary.scalar("eval/top5", record["top5"])
        tf.summary.scalar("train/images_per_sec", record["images_per_sec"])
        if "precise_bn_seconds" in record:  # --eval_bn_statistics=precise
            tf.summary.scalar("eval/moving_top1", record["moving_top1"])
            tf.summary.scalar("eval/moving_top5", record["moving_top5"])
            tf.summary.scalar("eval/precise_bn_seconds", record["precise_bn_seconds"])
        reached = steps_to_target(history["evals"], self.config.target_accuracy)
        if reached is not None:
            tf.summary.scalar("eval/steps_to_target", reached)
        if self.monitor is not None:
            self.monitor.write_summaries(self.model, record["step"])


def write_summary(config, history):
    """summary.json: final and best top-1, steps to the target, the paper's numbers, config."""
    evals = history["evals"]
    json_files.write_json(
        os.path.join(config.model_dir, "summary.json"),
        {
            "variant": config.variant,
            "steps": history["steps"],
            "final": evals[-1] if evals else None,
            "best_top1": max((e["top1"] for e in evals), default=None),
            "steps_to_target": steps_to_target(evals, config.target_accuracy),
            "diverged": history.get("diverged"),
            "paper": inception_recipes.PAPER_RESULTS[config.variant],
            "config": config.flat_values(),
        },
    )
