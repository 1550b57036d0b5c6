"""The least a Keras layer costs on PyTorch: torch's own batch norm in the thinnest Keras layer.

`benchmarks.kernel_speed` and `benchmarks.model_speed` time it beside
keras_bn and Keras' layer ("keras layer floor"): the time above torch's
module alone is Keras' per-call cost (`Layer.__call__`), which any Keras
layer pays. Its γ and β are the module's, not Keras variables: in a model a
Keras optimizer does not update them, so the floor leaves that cost out too.
"""


def keras_wrapped(module, channels_first):
    """`module` (a `torch.nn.BatchNorm1d`/`2d`) called in the thinnest Keras layer.

    Args:
        module: the torch module; it keeps its own running statistics.
        channels_first: whether a 4-D input has its features second (it goes
            to the module as it is); channels-last 4-D inputs go through
            their NCHW view, as keras_bn's kernel sends them.

    Returns:
        A `keras.layers.Layer` whose call is the module's, in training or
        inference mode as the call says.
    """
    import keras

    class KerasWrapped(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            # Held in functions: Keras would wrap a module attribute in a
            # TorchModuleWrapper, a second Keras layer with its own cost.
            self.set_mode, self.run = module.train, module.__call__

        def build(self, input_shape):
            pass

        def call(self, x, training=None, **unused):
            # `**unused`: a functional model passes BN's `mask=None`; a named
            # `mask` argument would have Keras look for masks on every call.
            self.set_mode(bool(training))
            if len(x.shape) != 4 or channels_first:
                return self.run(x)
            return self.run(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)

    return KerasWrapped()
