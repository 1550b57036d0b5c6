"""The paper's ImageNet variants (§4.2) as recipe bundles.

Inception is the baseline: learning rate 0.0015, dropout 40%, LRN, L2 weight
decay, full photometric distortion. BN-Baseline adds BN before every
nonlinearity and changes nothing else. BN-x5 and BN-x30 apply the §4.2.1
changes: learning rate ×5 / ×30, dropout removed, L2 reduced 5×, learning
rate decayed 6× faster, LRN removed, training examples shuffled within
shards, photometric distortions reduced. BN-x5-Sigmoid is BN-x5 with
sigmoid instead of ReLU. Inception-x5 is Inception at BN-x5's learning
rate, the paper's check that without BN the ×5 rate fails (§4.2.2: "the
parameters reach machine infinity"). Individual flags override any field.

The decay intervals are for runs of REFERENCE_TRAIN_STEPS steps (12.5
decays of the baseline, 75 of the accelerated recipes); `scaled_to`
rescales them to a shorter run, keeping the number of decays per run.

Values the paper does not state (the baseline's L2 coefficient, decay rate
and decay interval, momentum) are this project's choices, marked below.
"""

import dataclasses

from trainers.run import run_config

PAPER_DATASET = "imagenet2012"  # TFDS's name of the paper's ImageNet (ILSVRC 2012).
BASE_LEARNING_RATE = 0.0015  # Paper §4.2.2.
BASE_WEIGHT_DECAY = 4e-5  # Not stated in the paper (our choice).
BASE_DECAY_STEPS = 240_000  # Steps per ×DECAY_RATE decay; not stated (our choice).
DECAY_RATE = 0.94  # Not stated (our choice).
MOMENTUM = 0.9  # Not stated (our choice).
REFERENCE_TRAIN_STEPS = 3_000_000  # The run length BASE_DECAY_STEPS is chosen for.


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A variant's recipe; a resumed run may change its learning rate and decay interval."""

    batch_norm: bool
    activation: str
    learning_rate: float = run_config.changeable_field()
    dropout: float
    weight_decay: float
    decay_steps: int = run_config.changeable_field()
    lrn: bool
    distortion: float  # Strength of photometric distortion, 1.0 = full.
    thorough_shuffle: bool


_INCEPTION = Recipe(
    batch_norm=False,
    activation="relu",
    learning_rate=BASE_LEARNING_RATE,
    dropout=0.4,
    weight_decay=BASE_WEIGHT_DECAY,
    decay_steps=BASE_DECAY_STEPS,
    lrn=True,
    distortion=1.0,
    thorough_shuffle=False,
)
_BN_BASELINE = dataclasses.replace(_INCEPTION, batch_norm=True)


def _accelerated(multiple, activation="relu"):
    return dataclasses.replace(
        _BN_BASELINE,
        activation=activation,
        learning_rate=BASE_LEARNING_RATE * multiple,
        dropout=0.0,
        weight_decay=BASE_WEIGHT_DECAY / 5,
        decay_steps=BASE_DECAY_STEPS // 6,
        lrn=False,
        distortion=0.5,
        thorough_shuffle=True,
    )


RECIPES = {
    "inception": _INCEPTION,
    "bn_baseline": _BN_BASELINE,
    "bn_x5": _accelerated(5),
    "bn_x30": _accelerated(30),
    "bn_x5_sigmoid": _accelerated(5, activation="sigmoid"),
    "inception_x5": dataclasses.replace(_INCEPTION, learning_rate=BASE_LEARNING_RATE * 5),
}
# The five variants of the paper's Table 2, in its order.
TABLE2_VARIANTS = ("inception", "bn_baseline", "bn_x5", "bn_x30", "bn_x5_sigmoid")

# Paper Table 2 / Figure 3, for comparison in README and summaries.
PAPER_RESULTS = {
    "inception": {"steps_to_72.2%": 31.0e6, "max_accuracy": 0.722},
    "bn_baseline": {"steps_to_72.2%": 13.3e6, "max_accuracy": 0.727},
    "bn_x5": {"steps_to_72.2%": 2.1e6, "max_accuracy": 0.730},
    "bn_x30": {"steps_to_72.2%": 2.7e6, "max_accuracy": 0.748},
    "bn_x5_sigmoid": {"steps_to_72.2%": None, "max_accuracy": 0.698},
    # §4.2.2 reports no accuracy: the run diverged.
    "inception_x5": {"steps_to_72.2%": None, "max_accuracy": None},
}


def resolve(variant, **overrides):
    """The variant's recipe with every non-None override applied."""
    return dataclasses.replace(
        RECIPES[variant], **{k: v for k, v in overrides.items() if v is not None}
    )


def scaled_to(recipe, train_steps):
    """`recipe` with its decay interval scaled to a run of `train_steps` steps.

    A run of `train_steps` then decays its learning rate as many times as a
    run of REFERENCE_TRAIN_STEPS does with the recipe's own interval.
    """
    steps = max(1, round(recipe.decay_steps * train_steps / REFERENCE_TRAIN_STEPS))
    return dataclasses.replace(recipe, decay_steps=steps)
