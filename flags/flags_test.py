"""Parsing and validation of the shared flags."""

from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver
from absl.testing import parameterized
import keras

from flags import distribution_flags as distribution_flags
from flags import run_flags as run_flags
from flags import training_flags as training_flags

FLAGS = flags.FLAGS
# A strategy each engine runs, with its arguments.
STRATEGY_ARGS = {
    "tensorflow": ("tpu", ["--distribution_strategy=tpu", "--tpu=local"]),
    "jax": ("data_parallel", ["--distribution_strategy=data_parallel"]),
}


class FlagsTest(parameterized.TestCase):
    def test_defaults(self):
        with flagsaver.flagsaver():
            FLAGS(["prog"])
            self.assertEqual(run_flags.MODEL_DIR.value, "runs/default")
            self.assertIsNone(run_flags.DATA_DIR.value)
            self.assertEqual(distribution_flags.DISTRIBUTION_STRATEGY.value, "off")

    def test_trainer_sets_its_defaults_of_the_training_flags(self):
        # A trainer run as a program sets these; a flag given on the command line keeps its value.
        with flagsaver.flagsaver():
            training_flags.set_defaults(
                train_steps=7, batch_size=3, learning_rate=None, eval_every=2
            )
            FLAGS(["prog", "--batch_size=5"])
            self.assertEqual(training_flags.TRAIN_STEPS.value, 7)
            self.assertEqual(FLAGS["train_steps"].default, 7)
            self.assertEqual(training_flags.BATCH_SIZE.value, 5)
            self.assertIsNone(training_flags.LEARNING_RATE.value)
            self.assertEqual(training_flags.EVAL_EVERY.value, 2)

    def test_parses_values(self):
        with flagsaver.flagsaver():
            FLAGS(
                [
                    "prog",
                    "--train_steps=7",
                    "--batch_size=32",
                    "--learning_rate=0.25",
                    "--seed=3",
                    "--eval_every=2",
                    *STRATEGY_ARGS[keras.backend.backend()][1],
                    "--data_dir=/d",
                    "--model_dir=/m",
                ]
            )
            self.assertEqual(training_flags.TRAIN_STEPS.value, 7)
            self.assertEqual(training_flags.BATCH_SIZE.value, 32)
            self.assertEqual(training_flags.LEARNING_RATE.value, 0.25)
            self.assertEqual(run_flags.SEED.value, 3)
            self.assertEqual(
                distribution_flags.DISTRIBUTION_STRATEGY.value,
                STRATEGY_ARGS[keras.backend.backend()][0],
            )

    @parameterized.named_parameters(
        ("negative_steps", "--train_steps=-5", r"--train_steps=-5: -5 is not a positive integer"),
        ("zero_batch", "--batch_size=0", r"--batch_size=0: 0 is not a positive integer"),
        ("zero_learning_rate", "--learning_rate=0", r"learning_rate must be a finite number > 0"),
        ("infinite_learning_rate", "--learning_rate=inf", r"must be a finite number > 0"),
        ("nan_learning_rate", "--learning_rate=nan", r"must be a finite number > 0"),
        ("negative_seed", "--seed=-1", r"--seed=-1: -1 is not a non-negative integer"),
        ("bad_enum", "--distribution_strategy=horovod", r"distribution_strategy.*one of"),
        ("empty_model_dir", "--model_dir= ", r"model_dir must not be empty"),
        (
            "address_without_tpu",
            "--tpu=grpc://1.2.3.4:8470",
            r"only used with --distribution_strategy=tpu",
        ),
        (
            "zero_group_size",
            "--sync_group_size=0",
            r"--sync_group_size=0: 0 is not a positive integer",
        ),
        (
            "group_size_without_sync",
            "--sync_group_size=2",
            r"--sync_group_size groups.*needs --sync_batch_norm",
        ),
    )
    def test_rejects(self, argument, pattern):
        with flagsaver.flagsaver():
            with self.assertRaisesRegex(flags.IllegalFlagValueError, pattern):
                FLAGS(["prog", argument])

    def test_strategies_of_the_other_engine_are_rejected_in_one_line(self):
        engine = keras.backend.backend()
        others = set(distribution_flags.STRATEGIES) - set(
            distribution_flags.ENGINE_STRATEGIES[engine]
        )
        self.assertNotEmpty(others)
        for strategy in sorted(others):
            with flagsaver.flagsaver():
                with self.assertRaisesRegex(
                    flags.IllegalFlagValueError,
                    rf"--distribution_strategy={strategy} does not run under "
                    rf"KERAS_BACKEND={engine}; this engine runs off, ",
                ):
                    address = ["--tpu=local"] if strategy == "tpu" else []
                    FLAGS(["prog", f"--distribution_strategy={strategy}", *address])

    def test_tpu_needs_its_address(self):
        if keras.backend.backend() != "tensorflow":
            self.skipTest("TPUStrategy is TensorFlow's")
        with flagsaver.flagsaver():
            with self.assertRaisesRegex(flags.IllegalFlagValueError, r"needs --tpu"):
                FLAGS(["prog", "--distribution_strategy=tpu"])

    def test_gpu_split_only_on_tensorflow(self):
        argv = ["prog", "--num_gpu_devices=2"]
        with flagsaver.flagsaver():
            if keras.backend.backend() == "tensorflow":
                FLAGS(argv)
                self.assertEqual(distribution_flags.NUM_GPU_DEVICES.value, 2)
            else:
                with self.assertRaisesRegex(flags.IllegalFlagValueError, "does not apply under"):
                    FLAGS(argv)


if __name__ == "__main__":
    absltest.main()
