"""The paper's ImageNet variants (§4.2) as recipe bundles.

Inception is the baseline: learning rate 0.0015, dropout 40%, LRN, L2 weight
decay, full photometric distortion. BN-Baseline adds BN before every
nonlinearity and changes nothing else. BN-x5 and BN-x30 apply the §4.2.1
changes: learning rate ×5 / ×30, dropout removed, L2 reduced 5×, learning
rate decayed 6× faster, LRN removed, training examples shuffled within
shards, photometric distortions reduced. BN-x5-Sigmoid is BN-x5 with
sigmoid instead of ReLU. Individual flags override any field.

Values the paper does not state (the baseline's L2 coefficient, decay rate
and decay interval, momentum) are this project's choices, marked below.
"""

import dataclasses

BASE_LEARNING_RATE = 0.0015  # Paper §4.2.2.
BASE_WEIGHT_DECAY = 4e-5  # Not stated in the paper (our choice).
BASE_DECAY_STEPS = 240_000  # Steps per ×DECAY_RATE decay; not stated (our choice).
DECAY_RATE = 0.94  # Not stated (our choice).
MOMENTUM = 0.9  # Not stated (our choice).


@dataclasses.dataclass(frozen=True)
class Recipe:
    batch_norm: bool
    activation: str
    learning_rate: float
    dropout: float
    weight_decay: float
    decay_steps: int
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
}

# Paper Table 2 / Figure 3, for comparison in README and summaries.
PAPER_RESULTS = {
    "inception": {"steps_to_72.2%": 31.0e6, "max_accuracy": 0.722},
    "bn_baseline": {"steps_to_72.2%": 13.3e6, "max_accuracy": 0.727},
    "bn_x5": {"steps_to_72.2%": 2.1e6, "max_accuracy": 0.730},
    "bn_x30": {"steps_to_72.2%": 2.7e6, "max_accuracy": 0.748},
    "bn_x5_sigmoid": {"steps_to_72.2%": None, "max_accuracy": 0.698},
}


def resolve(variant, **overrides):
    """The variant's recipe with every non-None override applied."""
    return dataclasses.replace(
        RECIPES[variant], **{k: v for k, v in overrides.items() if v is not None}
    )
