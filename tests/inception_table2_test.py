"""Tests of the miniature Table 2 (`--variant=all`): its summary, driver, flags, real-data smoke."""

import json
import os
import tempfile

from absl import flags
from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tests import flag_state
from tests import image_data_test
from tests import tensorboard_events
from trainers import inception_bn
from trainers import inception_recipes
from trainers import inception_table2


def setUpModule():
    flag_state.ensure_parsed()


def _evals(*top1s, every=100):
    return [{"step": every * (i + 1), "top1": top1} for i, top1 in enumerate(top1s)]


# Synthetic histories: Inception peaks at 0.6 (step 300), BN-x5 passes it at
# step 200, BN-Baseline peaks at 0.6 exactly, the sigmoid variant never gets there.
HISTORIES = {
    "inception": _evals(0.3, 0.5, 0.6, 0.55),
    "bn_baseline": _evals(0.2, 0.4, 0.5, 0.6),
    "bn_x5": _evals(0.1, 0.7, 0.8, 0.79),
    "bn_x5_sigmoid": _evals(0.1, 0.2, 0.3, 0.35),
}


class Table2Test(parameterized.TestCase):
    def test_steps_to_the_inception_maximum(self):
        table = inception_table2.table2(HISTORIES)
        self.assertEqual(table["reference_variant"], "inception")
        self.assertEqual(table["reference_top1"], 0.6)
        rows = table["rows"]
        self.assertEqual(
            {v: (r["max_top1"], r["max_step"], r["steps_to_reference"]) for v, r in rows.items()},
            {
                "inception": (0.6, 300, 300),
                "bn_baseline": (0.6, 400, 400),  # Reaching it counts: ≥, not >.
                "bn_x5": (0.8, 300, 200),
                "bn_x5_sigmoid": (0.35, 400, None),
            },
        )
        self.assertEqual(rows["bn_x5"]["paper"], inception_recipes.PAPER_RESULTS["bn_x5"])
        self.assertEqual(rows["bn_x5"]["steps"], 400)

    def test_without_inception_there_is_no_reference(self):
        table = inception_table2.table2({"bn_x5": HISTORIES["bn_x5"], "bn_x30": []})
        self.assertIsNone(table["reference_top1"])
        self.assertIsNone(table["rows"]["bn_x5"]["steps_to_reference"])
        self.assertEqual(table["rows"]["bn_x5"]["max_top1"], 0.8)
        self.assertIsNone(table["rows"]["bn_x30"]["max_top1"])
        self.assertEqual(table["rows"]["bn_x30"]["steps"], 0)

    def test_markdown_puts_the_paper_beside_the_measurement(self):
        lines = inception_table2.markdown(inception_table2.table2(HISTORIES)).splitlines()
        self.assertEqual(
            lines[0],
            "| variant | steps to 60.0% | max top-1 | paper: steps to 72.2% | paper: max |",
        )
        self.assertEqual(lines[2], "| inception | 300 | 60.0% | 31·10⁶ | 72.2% |")
        self.assertEqual(lines[4], "| bn_x5 | 200 | 80.0% | 2.1·10⁶ | 73.0% |")
        self.assertEqual(lines[5], "| bn_x5_sigmoid | — | 35.0% | — | 69.8% |")

    @parameterized.parameters((False, 5), (True, 6))
    def test_variants(self, with_inception_x5, count):
        names = inception_table2.variants(with_inception_x5)
        self.assertLen(names, count)
        self.assertEqual(names[:5], inception_recipes.TABLE2_VARIANTS)
        self.assertEqual(names[0], inception_table2.REFERENCE)

    def test_variant_configs_scale_the_decay_and_share_the_rest(self):
        config = _all_config(train_steps=1500)
        self.assertIsNone(config.recipe)
        configs = {v: inception_table2.variant_config(config, v) for v in ("inception", "bn_x30")}
        # 240,000 steps per decay in 3,000,000 → 120 in 1,500; the accelerated 6× faster.
        self.assertEqual(configs["inception"].recipe.decay_steps, 120)
        self.assertEqual(configs["bn_x30"].recipe.decay_steps, 20)
        self.assertEqual(configs["bn_x30"].recipe.learning_rate, 0.045)
        self.assertEqual(configs["bn_x30"].model_dir, os.path.join(config.model_dir, "bn_x30"))
        for one in configs.values():
            self.assertEqual((one.seed, one.train_steps), (config.seed, config.train_steps))


class AllFlagsTest(parameterized.TestCase):
    @parameterized.parameters(
        "--learning_rate=0.1", "--dropout=0.2", "--weight_decay=0.0", "--lr_decay_steps=10"
    )
    def test_all_refuses_recipe_overrides(self, override):
        with flag_state.trainer_flags(inception_bn):
            with self.assertRaisesRegex(
                flags.IllegalFlagValueError, r"--variant=all trains every variant with its own"
            ):
                flags.FLAGS(["prog", "--variant=all", override])

    def test_inception_x5_needs_all(self):
        with flag_state.trainer_flags(inception_bn):
            with self.assertRaisesRegex(flags.IllegalFlagValueError, r"--with_inception_x5 adds"):
                flags.FLAGS(["prog", "--variant=bn_x5", "--with_inception_x5"])

    @parameterized.parameters(
        ["--variant=all", "--with_inception_x5", "--dataset=fashion_mnist"],
        ["--variant=inception_x5", "--learning_rate=0.01"],
        ["--variant=bn_x5", "--lr_decay_steps=10"],
    )
    def test_accepted_combinations(self, *args):
        with flag_state.trainer_flags(inception_bn):
            flags.FLAGS(["prog", *args])
            self.assertEqual(flags.FLAGS.variant, args[0].split("=")[1])

    def test_all_config_records_no_recipe(self):
        values = inception_bn.config_values(_all_config(with_inception_x5=True))
        self.assertEqual(values["variant"], "all")
        self.assertTrue(values["with_inception_x5"])
        self.assertFalse([k for k in values if k.startswith("recipe.")])


class DriverTest(absltest.TestCase):
    def test_writes_after_each_variant_then_the_figure(self):
        config = _all_config(train_steps=400)
        seen = []

        def train_variant(one):
            if seen:  # The previous variants' rows are on disk before this one trains.
                with open(os.path.join(config.model_dir, "summary.json")) as f:
                    self.assertCountEqual(json.load(f)["rows"], seen)
            seen.append(one.variant)
            evals = HISTORIES.get(one.variant, _evals(0.4, 0.65, 0.7, 0.75))
            return {"evals": evals, "steps": 400, "wall_time_s": 12.0}

        table = inception_table2.run(config, train_variant, inception_bn.config_values)
        self.assertEqual(seen, list(inception_recipes.TABLE2_VARIANTS))
        self.assertEqual(table["rows"]["bn_x30"]["steps_to_reference"], 200)
        with open(os.path.join(config.model_dir, "summary.json")) as f:
            summary = json.load(f)
        self.assertEqual(summary["reference_top1"], 0.6)
        self.assertEqual(summary["variants"]["bn_x5"], {"wall_time_s": 12.0, "decay_steps": 5})
        self.assertEqual(summary["config"]["variant"], "all")
        with open(os.path.join(config.model_dir, "table2.md")) as f:
            self.assertIn("| bn_x30 | 200 | 75.0% | 2.7·10⁶ | 74.8% |", f.read())
        with open(os.path.join(config.model_dir, "figure2.png"), "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        plugins = tensorboard_events.read_plugins(config.model_dir)
        self.assertEqual(plugins["figure2"], "images")
        self.assertIn("custom_scalars", plugins.values())


def _all_config(**overrides):
    values = dict(variant="all", dataset="fashion_mnist", model_dir=tempfile.mkdtemp())
    with flag_state.trainer_flags(inception_bn, **{**values, **overrides}):
        return inception_bn.config_from_flags()


# A class-level mark: absl's parameterized copies do not inherit method marks.
@pytest.mark.slow
class RealDataTest(absltest.TestCase):
    def test_bn_x5_learns_fashion_mnist(self):
        """A short BN-x5 run on the real Fashion-MNIST is far above chance (10%)."""
        if not os.path.isdir(os.path.join(image_data_test.FASHION_MNIST_DIR, "fashion_mnist")):
            self.skipTest(f"No fashion_mnist under {image_data_test.FASHION_MNIST_DIR}")
        model_dir = tempfile.mkdtemp()
        with flag_state.trainer_flags(
            inception_bn,
            variant="bn_x5",
            dataset="fashion_mnist",
            data_dir=image_data_test.FASHION_MNIST_DIR,
            model_dir=model_dir,
            image_size=32,
            batch_size=32,
            train_steps=SMOKE_STEPS,
            eval_every=SMOKE_STEPS,
            eval_steps=16,
        ):
            inception_bn.main(["inception_bn"])
        with open(os.path.join(model_dir, "summary.json")) as f:
            summary = json.load(f)
        self.assertEqual(summary["steps"], SMOKE_STEPS)
        self.assertGreater(summary["best_top1"], 0.4)


SMOKE_STEPS = 250


if __name__ == "__main__":
    absltest.main()
