"""The least a Keras layer costs on PyTorch: torch's own batch norm in the thinnest Keras layer.

`benchmarks.kernel_speed` and `benchmarks.model_speed` time it beside
keras_bn and Keras' layer ("keras layer floor"): ATen's batch norm, which
moves torch's running statistics inside its kernel, called by a Keras layer
whose γ and β are Keras weights (so that in a model the optimizer trains
them, as it trains any batch-norm layer's). The time above ATen's own is
Keras' per-call cost (`Layer.__call__`, the weights' reads), which any Keras
layer pays.
"""


def keras_wrapped(module, channels_first):
    """`module`'s batch norm (a `torch.nn.BatchNorm1d`/`2d`) in the thinnest Keras layer.

    Args:
        module: the torch module: its ε, momentum, running statistics (moved
            in ATen's kernel) and initial γ and β, which become Keras weights.
        channels_first: whether a 4-D input has its features second (it goes
            to ATen as it is); channels-last 4-D inputs go through their NCHW
            view, as keras_bn's kernel sends them.

    Returns:
        A `keras.layers.Layer` that normalises as the module does, in
        training or inference mode as the call says.
    """
    import keras
    import torch

    class KerasWrapped(keras.layers.Layer):
        def build(self, input_shape):
            # γ and β from the module, in float32 as the running statistics
            # (ATen's mixed-type kernel takes a 16-bit input with them).
            for name, value in (("gamma", module.weight), ("beta", module.bias)):
                initial = keras.initializers.Constant(value.detach().cpu().numpy())
                weight = self.add_weight(value.shape, initializer=initial, autocast=False)
                setattr(self, name, weight)
            module.to(self.gamma.value.device)  # Its running statistics where Keras computes.

        def call(self, x, training=None, **unused):
            # `**unused`: a functional model passes BN's `mask=None`; a named
            # `mask` argument would have Keras look for masks on every call.
            view = x if len(x.shape) != 4 or channels_first else x.permute(0, 3, 1, 2)
            y = torch.nn.functional.batch_norm(
                view,
                module.running_mean,
                module.running_var,
                self.gamma.value,
                self.beta.value,
                training=bool(training),
                momentum=module.momentum,
                eps=module.eps,
            )
            return y if view is x else y.permute(0, 2, 3, 1)

    return KerasWrapped()
