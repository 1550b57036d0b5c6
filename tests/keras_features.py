"""What the installed Keras' own layers take, for tests that build them beside keras_bn's.

setup.cfg's floor (Keras 3.10) is older than some arguments of Keras'
`BatchNormalization`: a test that needs one skips with `NO_KERAS_RENORM`.
"""

import keras


def _keras_takes_renorm():
    try:
        keras.layers.BatchNormalization(renorm=True)
    except (TypeError, ValueError):  # "Unrecognized keyword arguments" before Keras 3.14.
        return False
    return True


KERAS_HAS_RENORM = _keras_takes_renorm()
NO_KERAS_RENORM = (
    f"Keras {keras.__version__}'s BatchNormalization takes no renorm (Keras 3.14 added it)"
)
