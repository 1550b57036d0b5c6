"""Both trainers in one process: each keeps its own defaults; no import changes a flag."""

from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver

from flags import inception_flags
from flags import training_flags
from tests import flag_state
from trainers import inception_bn
from trainers import mnist_sigmoid
from trainers.inception import recipes as inception_recipes


class TrainerDefaultsTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        flag_state.ensure_parsed()

    def test_importing_both_trainers_changes_no_flag_default(self):
        for holder in (
            training_flags.TRAIN_STEPS,
            training_flags.BATCH_SIZE,
            training_flags.LEARNING_RATE,
            training_flags.EVAL_EVERY,
        ):
            self.assertIsNone(flags.FLAGS[holder.name].default, holder.name)

    def test_each_trainer_takes_its_own_defaults(self):
        with flagsaver.flagsaver():
            mnist = mnist_sigmoid.config_from_flags()
            inception = inception_bn.config_from_flags()
        self.assertEqual(
            (mnist.train_steps, mnist.batch_size, mnist.learning_rate, mnist.eval_every),
            (50_000, 60, 0.5, 500),
        )
        self.assertEqual(
            (inception.train_steps, inception.batch_size, inception.eval_every),
            (3_000_000, 32, 10_000),
        )
        # Unset, inception's learning rate is its --variant recipe's.
        recipe = inception_recipes.RECIPES[inception_flags.VARIANT.default]
        self.assertEqual(inception.recipe.learning_rate, recipe.learning_rate)

    def test_a_flag_given_wins_over_both_trainers_defaults(self):
        with flagsaver.flagsaver(train_steps=7, batch_size=4):
            mnist = mnist_sigmoid.config_from_flags()
            inception = inception_bn.config_from_flags()
        self.assertEqual((mnist.train_steps, mnist.batch_size), (7, 4))
        self.assertEqual((inception.train_steps, inception.batch_size), (7, 4))
        self.assertEqual((mnist.eval_every, inception.eval_every), (500, 10_000))


if __name__ == "__main__":
    absltest.main()
