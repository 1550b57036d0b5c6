"""The model the synchronised-statistics benchmarks train, on each engine's own set-up."""


def conv_net(bn_factory):
    """Conv → BN → ReLU, twice, then pooling and a dense head; `bn_factory()` makes each BN."""
    import keras  # Imported when called: a benchmark splits its devices first.

    return keras.Sequential(
        [
            keras.Input((32, 32, 16)),
            keras.layers.Conv2D(32, 3, padding="same", use_bias=False),
            bn_factory(),
            keras.layers.ReLU(),
            keras.layers.Conv2D(64, 3, padding="same", use_bias=False),
            bn_factory(),
            keras.layers.ReLU(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
