"""Tests of the miniature Table 2 (`--variant=all`): its summary, driver, flags, real-data smoke."""

import json
import os
import tempfile

from absl import flags
from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import pytest

from tests import flag_state
from tests import image_data_test
from tests import inception_bn_test
from tests import tensorboard_events
from trainers import inception_bn
from trainers.inception import recipes as inception_recipes
from trainers.inception import table2 as inception_table2


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
        values = _all_config(with_inception_x5=True).flat_values()
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

        table = inception_table2.run(config, train_variant)
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


# A second seed: Inception peaks at 0.5 (step 300), BN-Baseline never gets
# there, BN-x5 passes it at step 100 and peaks at 0.9, the sigmoid at step 400.
SEED_HISTORIES = {
    0: HISTORIES,
    1: {
        "inception": _evals(0.2, 0.4, 0.5, 0.5),
        "bn_baseline": _evals(0.1, 0.3, 0.45, 0.48),
        "bn_x5": _evals(0.55, 0.7, 0.9, 0.8),
        "bn_x5_sigmoid": _evals(0.1, 0.2, 0.3, 0.6),
    },
}


class SeedsTest(parameterized.TestCase):
    def test_spread_over_seeds_against_numpy(self):
        tables = {s: inception_table2.table2(h) for s, h in SEED_HISTORIES.items()}
        summary = inception_table2.over_seeds(tables)
        self.assertEqual(summary["seeds"], [0, 1])
        self.assertEqual(summary["per_seed"], tables)
        self.assertAlmostEqual(summary["reference_top1"]["mean"], 0.55)
        rows = summary["rows"]
        for variant in HISTORIES:
            best = [max(e["top1"] for e in h[variant]) for h in SEED_HISTORIES.values()]
            stats = rows[variant]["max_top1"]
            self.assertAlmostEqual(stats["mean"], np.mean(best), msg=variant)
            self.assertAlmostEqual(stats["std"], np.std(best), msg=variant)
            self.assertEqual((stats["min"], stats["max"], stats["count"]), (*sorted(best), 2))
            self.assertEqual(rows[variant]["seeds"], 2)
        steps = {v: rows[v]["steps_to_reference"] for v in rows}
        self.assertEqual(
            {v: (s["mean"], s["std"], s["min"], s["max"], s["count"]) for v, s in steps.items()},
            {
                "inception": (300.0, 0.0, 300, 300, 2),
                "bn_baseline": (400.0, 0.0, 400, 400, 1),
                "bn_x5": (150.0, 50.0, 100, 200, 2),
                "bn_x5_sigmoid": (400.0, 0.0, 400, 400, 1),
            },
        )
        self.assertEqual(
            {v: rows[v]["never_reached"] for v in rows},
            {"inception": 0, "bn_baseline": 1, "bn_x5": 0, "bn_x5_sigmoid": 1},
        )
        lines = inception_table2.markdown_over_seeds(summary).splitlines()
        self.assertIn("Over seeds 0, 1:", lines[0])
        self.assertIn("55.0% ± 5.0% (50.0%–60.0%)", lines[0])
        self.assertIn(
            "| bn_x5 | 2 | 150 ± 50 (100–200) | 0 | 85.0% ± 5.0% (80.0%–90.0%) | 2.1·10⁶ | 73.0% |",
            lines,
        )
        self.assertIn("| bn_x5_sigmoid | 2 | 400 ± 0 | 1 |", lines[-1])

    def test_a_seed_partly_run_counts_where_it_ran(self):
        tables = {
            0: inception_table2.table2(HISTORIES),
            1: inception_table2.table2({"inception": SEED_HISTORIES[1]["inception"]}),
        }
        rows = inception_table2.over_seeds(tables)["rows"]
        self.assertEqual((rows["inception"]["seeds"], rows["bn_x5"]["seeds"]), (2, 1))
        self.assertEqual(rows["bn_x5"]["max_top1"]["mean"], 0.8)

    def test_spread_of_nothing(self):
        self.assertEqual(
            inception_table2.spread([None]),
            {"mean": None, "std": None, "min": None, "max": None, "count": 0},
        )

    def test_band_figure(self):
        runs = {v: [h[v] for h in SEED_HISTORIES.values()] for v in HISTORIES}
        runs["bn_x30"] = [_evals(0.1, 0.2), _evals(0.3, 0.4, 0.5)]  # Steps both have: 100, 200.
        steps, mean, low, high = inception_table2._mean_and_band(runs["bn_x30"])
        self.assertEqual(steps, [100, 200])
        np.testing.assert_allclose(mean, [0.2, 0.3])
        np.testing.assert_allclose((low, high), ([0.1, 0.2], [0.3, 0.4]))
        path = os.path.join(tempfile.mkdtemp(), "figure2.png")
        png = inception_table2.plot_figure(runs, [0.6, 0.5], path)
        self.assertEqual(png[:8], b"\x89PNG\r\n\x1a\n")
        with open(path, "rb") as f:
            self.assertEqual(f.read(), png)

    def test_driver_trains_every_variant_per_seed(self):
        config = _all_config(train_steps=400, num_seeds=2, seed=3)
        seen = []

        def train_variant(one):
            seen.append((one.seed, one.variant))
            self.assertEqual(
                one.model_dir, os.path.join(config.model_dir, one.variant, f"seed_{one.seed}")
            )
            evals = SEED_HISTORIES[one.seed - 3].get(one.variant, _evals(0.4, 0.65, 0.7, 0.75))
            return {"evals": evals, "steps": 400, "wall_time_s": 12.0}

        summary = inception_table2.run(config, train_variant)
        variants = inception_recipes.TABLE2_VARIANTS
        self.assertEqual(seen, [(s, v) for s in (3, 4) for v in variants])
        self.assertEqual(summary["rows"]["bn_x5"]["steps_to_reference"]["mean"], 150.0)
        with open(os.path.join(config.model_dir, "summary.json")) as f:
            written = json.load(f)
        self.assertEqual(sorted(written["per_seed"]), ["3", "4"])
        self.assertEqual(written["per_seed"]["4"]["reference_top1"], 0.5)
        self.assertEqual(written["variants"]["bn_x5"], {"wall_time_s": 24.0, "decay_steps": 5})
        self.assertEqual(written["config"]["num_seeds"], 2)
        with open(os.path.join(config.model_dir, "table2.md")) as f:
            self.assertIn("| bn_x5 | 2 | 150 ± 50 (100–200) |", f.read())
        self.assertTrue(os.path.exists(os.path.join(config.model_dir, "figure2.png")))
        self.assertEqual(tensorboard_events.read_plugins(config.model_dir)["figure2"], "images")

    def test_several_seeds_need_all(self):
        with flag_state.trainer_flags(inception_bn, num_seeds=2, variant="bn_x5"):
            with self.assertRaisesRegex(
                flags.ValidationError,
                r"--num_seeds > 1 repeats.*Received: num_seeds=2, variant=bn_x5",
            ):
                inception_bn.config_from_flags()


# Ten runs (five variants, two seeds), each built and compiled: three to
# four minutes on two CPU cores, so slow although each run trains four steps.
# The smoke run of every variant (its metrics, event tags, BN health and
# checkpoint), in two compiled calls of two steps.
@pytest.mark.slow
class SeedsSmokeTest(absltest.TestCase):
    def test_fake_data_two_seeds(self):
        """--variant=all --num_seeds=2 on fake data: each run's directory, the table, the figure."""
        model_dir = tempfile.mkdtemp()
        with flag_state.trainer_flags(
            inception_bn,
            variant="all",
            num_seeds=2,
            model_dir=model_dir,
            **dict(inception_bn_test.MANY_RUNS_SMOKE, train_steps=4, steps_per_execution=2),
        ):
            inception_bn.main(["inception_bn"])
        for variant in inception_recipes.TABLE2_VARIANTS:
            for seed in (0, 1):
                run_dir = os.path.join(model_dir, variant, f"seed_{seed}")
                with open(os.path.join(run_dir, "summary.json")) as f:
                    run = json.load(f)
                tags = inception_bn_test.check_run(self, run_dir, run, 4)  # Its steps among them.
                self.assertEqual([s for s, _ in tags["eval/top1"]], [2, 4])  # Two compiled calls.
                self.assertEqual(run["config"]["seed"], seed)
                self.assertEqual(run["config"]["width_multiplier"], 0.05)
                self.assertEqual(run["config"]["steps_per_execution"], 2)
                self.assertEqual(run["paper"], inception_recipes.PAPER_RESULTS[variant])
        with open(os.path.join(model_dir, "summary.json")) as f:
            summary = json.load(f)
        self.assertEqual(sorted(summary["per_seed"]), ["0", "1"])
        self.assertEqual(summary["rows"]["bn_x30"]["seeds"], 2)
        with open(os.path.join(model_dir, "table2.md")) as f:
            self.assertIn("| bn_x5_sigmoid | 2 |", f.read())
        with open(os.path.join(model_dir, "figure2.png"), "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


def _all_config(**overrides):
    values = dict(variant="all", dataset="fashion_mnist", model_dir=tempfile.mkdtemp())
    with flag_state.trainer_flags(inception_bn, **{**values, **overrides}):
        return inception_bn.config_from_flags()


# A class-level mark: a mark above `@parameterized` does not reach absl's copies (CONTRIBUTING.md).
@pytest.mark.slow
class RealDataTest(absltest.TestCase):
    def test_bn_x5_learns_fashion_mnist(self):
        """A short BN-x5 run on the real Fashion-MNIST is far above chance (10%).

        Deterministic (`--deterministic`, the default: the same top-1 at every
        run on one machine and engine), evaluated with precise BN statistics:
        at 300 steps the moving statistics (momentum 0.99) still lag the
        network, and their top-1 spread over seeds was four times the precise
        one (see REAL_DATA_TOP1_FLOOR).
        """
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
            width_multiplier=0.25,
            train_steps=SMOKE_STEPS,
            eval_every=SMOKE_STEPS,
            eval_steps=64,
            eval_bn_statistics="precise",
            precise_bn_batches=10,
        ):
            inception_bn.main(["inception_bn"])
        with open(os.path.join(model_dir, "summary.json")) as f:
            summary = json.load(f)
        self.assertEqual(summary["steps"], SMOKE_STEPS)
        self.assertIn("moving_top1", summary["final"])
        self.assertGreater(summary["best_top1"], REAL_DATA_TOP1_FLOOR)


SMOKE_STEPS = 300
# The test's command with --seed=0..4 (2026-12-05, 2-core AMD EPYC, TF 2.21.0, oneDNN on, at
# commit ae84fbe) ended at precise top-1 0.613, 0.613, 0.670, 0.646, 0.654 (mean 0.639, std
# 0.023); with the moving statistics 0.558, 0.497, 0.653, 0.536, 0.360 (std 0.095). The floor is
# 0.16 under the lowest precise value, 8 standard deviations under the mean, so another
# machine's rounding cannot cross it, while a network that does not learn (10%) fails.
REAL_DATA_TOP1_FLOOR = 0.45


if __name__ == "__main__":
    absltest.main()
