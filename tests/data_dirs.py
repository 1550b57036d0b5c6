"""Where the tests find real data sets: the TFDS copy in `../shared/data` beside the checkout."""

import os

# ../shared/data/tensorflow_datasets from the repository root (mnist, fashion_mnist).
SHARED_DATA = os.path.normpath(
    os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "..",
        "..",
        "shared",
        "data",
        "tensorflow_datasets",
    )
)
