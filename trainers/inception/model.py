"""BN-Inception (paper appendix, Figure 5) as a Keras functional model.

The network of Ioffe & Szegedy's Figure 5: a 7×7/2 depthwise-separable stem
(depth multiplier 8), max pool, 1×1 and 3×3 convolutions, max pool, Inception
modules 3a–3c, 4a–4e, 5a–5b with every 5×5 replaced by two 3×3 convolutions,
global average pooling and a softmax classifier as the only fully connected
layer.

Where the printed table is inconsistent, the per-branch filter counts win:
- 4c (160 + 160 + 160 + 128) and 4d (96 + 192 + 192 + 128) sum to 608, not
  the printed 576; they output 608 channels, so 4e outputs
  192 + 256 + 608 = 1056 (not 1024) and 5a takes 1056 channels in.
- 3c is printed as 28×28×576, but it has stride 2: it outputs 14×14×576.
- The final 7×7 average pool is a global average pool, identical at 224 and
  also valid for the small `image_size` used in tests.
With these choices BN-Inception has 11,298,560 parameters at 1000 classes
(11,278,528 trainable, the rest moving statistics; measured with
`count_params`), and Inception without BN 11,268,512. The paper quotes
13.6M; the table as printed does not account for the difference.

`width_multiplier` scales every convolution's filter count (stem and every
branch of every module; rounded, at least 1) and keeps the depth multiplier
of the separable stem, so that a miniature of the paper's experiments fits on
a few CPU cores; at 1.0 the network is the paper's.
"""

import math

import keras

import keras_bn

# name: (#1x1, #3x3 reduce, #3x3, double #3x3 reduce, double #3x3, pool, proj, stride)
# pool "avg"/"max"; proj 0 with stride 2 means "pass through" (no projection).
MODULES = (
    ("3a", 64, 64, 64, 64, 96, "avg", 32, 1),
    ("3b", 64, 64, 96, 64, 96, "avg", 64, 1),
    ("3c", 0, 128, 160, 64, 96, "max", 0, 2),
    ("4a", 224, 64, 96, 96, 128, "avg", 128, 1),
    ("4b", 192, 96, 128, 96, 128, "avg", 128, 1),
    ("4c", 160, 128, 160, 128, 160, "avg", 128, 1),
    ("4d", 96, 128, 192, 160, 192, "avg", 128, 1),
    ("4e", 0, 128, 192, 192, 256, "max", 0, 2),
    ("5a", 352, 192, 320, 160, 224, "avg", 128, 1),
    ("5b", 352, 192, 320, 192, 224, "max", 128, 1),
)


class _Builder:
    """Adds conv → (BN) → nonlinearity units with the variant's choices."""

    def __init__(
        self,
        batch_norm,
        activation,
        weight_decay,
        sync_batch_norm,
        sync_group_size,
        batch_norm_layer,
        width_multiplier=1.0,
    ):
        self.batch_norm = batch_norm
        self.width_multiplier = width_multiplier
        self.batch_norm_layer = batch_norm_layer or keras_bn.BatchNormalization
        self.activation = activation
        self.regularizer = keras.regularizers.L2(weight_decay) if weight_decay else None
        self.batch_norm_options = dict(synchronized=sync_batch_norm, epsilon=1e-3)
        if sync_group_size is not None:  # keras_bn only; Keras' layer has no groups.
            self.batch_norm_options["sync_group_size"] = sync_group_size
        if self.batch_norm_layer is keras_bn.BatchNormalization:
            # The run's TensorBoard shows each layer's skipped updates.
            self.batch_norm_options["count_skipped_updates"] = True

    def conv(self, x, filters, kernel, strides=1, name=None, separable=False):
        filters = max(1, round(filters * self.width_multiplier))
        common = dict(strides=strides, padding="same", use_bias=not self.batch_norm, name=name)
        if separable:
            x = keras.layers.SeparableConv2D(
                filters,
                kernel,
                depth_multiplier=8,
                depthwise_regularizer=self.regularizer,
                pointwise_regularizer=self.regularizer,
                **common,
            )(x)
        else:
            x = keras.layers.Conv2D(filters, kernel, kernel_regularizer=self.regularizer, **common)(
                x
            )
        if self.batch_norm:
            # BN before the nonlinearity, replacing the conv's bias (paper §3.2).
            x = self.batch_norm_layer(name=f"{name}_bn", **self.batch_norm_options)(x)
        return keras.layers.Activation(self.activation, name=f"{name}_act")(x)

    def module(self, x, spec):
        name, n1, r3, n3, rd, nd, pool, proj, stride = spec
        p = f"inception_{name}"
        branches = []
        if n1:
            branches.append(self.conv(x, n1, 1, name=f"{p}_1x1"))
        b = self.conv(x, r3, 1, name=f"{p}_3x3_reduce")
        branches.append(self.conv(b, n3, 3, strides=stride, name=f"{p}_3x3"))
        b = self.conv(x, rd, 1, name=f"{p}_double_3x3_reduce")
        b = self.conv(b, nd, 3, name=f"{p}_double_3x3a")
        branches.append(self.conv(b, nd, 3, strides=stride, name=f"{p}_double_3x3b"))
        pool_layer = keras.layers.AveragePooling2D if pool == "avg" else keras.layers.MaxPooling2D
        b = pool_layer(3, strides=stride, padding="same", name=f"{p}_{pool}_pool")(x)
        if proj:
            b = self.conv(b, proj, 1, name=f"{p}_pool_proj")
        branches.append(b)
        return keras.layers.Concatenate(name=f"{p}_concat")(branches)


def _lrn(name):
    import tensorflow as tf  # LRN has no keras.ops equivalent.

    return keras.layers.Lambda(
        lambda t: tf.nn.local_response_normalization(
            t, depth_radius=2, bias=1.0, alpha=2e-5, beta=0.75
        ),
        name=name,
    )


def bn_stage(layer_name):
    """The network stage a BN layer belongs to: stem, or Inception stage 3, 4 or 5.

    Used to aggregate the 69 BN layers' health summaries per stage.
    """
    if layer_name.startswith("inception_"):
        return f"bn_stage_{layer_name[len('inception_')]}"
    return "bn_stage_stem"


def build_inception(
    *,
    image_size=224,
    num_classes=1000,
    batch_norm=True,
    activation="relu",
    lrn=False,
    dropout=0.0,
    weight_decay=0.0,
    sync_batch_norm=False,
    sync_group_size=None,
    batch_norm_layer=None,
    momentum_warmup=False,
    width_multiplier=1.0,
):
    """Returns the BN-Inception (or, with batch_norm=False, Inception) model.

    Args:
        image_size: int, input height and width (224 in the paper).
        num_classes: int, softmax classes.
        batch_norm: BN (keras_bn) before every nonlinearity, convs unbiased.
        activation: "relu" or "sigmoid" (BN-x5-Sigmoid).
        lrn: local response normalisation after the stem and the 3×3 conv
            (GoogLeNet's; removed with BN).
        dropout: dropout rate before the classifier (0.4 in Inception).
        weight_decay: L2 coefficient on convolution and classifier kernels.
        sync_batch_norm: synchronised BN moments across replicas.
        sync_group_size: replicas per synchronisation group (`None`: all).
        batch_norm_layer: the BN class (default `keras_bn.BatchNormalization`;
            the benchmark passes `keras.layers.BatchNormalization`).
        momentum_warmup: the BN layers warm their momentum up (keras_bn's
            `momentum_warmup=True`).
        width_multiplier: float > 0, scales every convolution's filter count
            (rounded, at least 1); 1.0 is the paper's network.

    Returns:
        A `keras.Model` from standardised float images `(image_size,
        image_size, 3)` to `num_classes` float32 logits.

    Raises:
        ValueError: if `width_multiplier` is not a finite number > 0.
    """
    if not (isinstance(width_multiplier, (int, float)) and 0 < width_multiplier < math.inf):
        raise ValueError(
            "`width_multiplier` must be a finite number > 0. "
            f"Received: width_multiplier={width_multiplier!r}"
        )
    b = _Builder(
        batch_norm,
        activation,
        weight_decay,
        sync_batch_norm,
        sync_group_size,
        batch_norm_layer,
        width_multiplier,
    )
    if momentum_warmup:  # keras_bn only; Keras' layer has no warm-up.
        b.batch_norm_options["momentum_warmup"] = True
    inputs = keras.Input((image_size, image_size, 3), name="image")
    x = b.conv(inputs, 64, 7, strides=2, name="conv1_7x7", separable=True)
    x = keras.layers.MaxPooling2D(3, strides=2, padding="same", name="pool1")(x)
    if lrn:
        x = _lrn("lrn1")(x)
    x = b.conv(x, 64, 1, name="conv2_3x3_reduce")
    x = b.conv(x, 192, 3, name="conv2_3x3")
    if lrn:
        x = _lrn("lrn2")(x)
    x = keras.layers.MaxPooling2D(3, strides=2, padding="same", name="pool2")(x)
    for spec in MODULES:
        x = b.module(x, spec)
    x = keras.layers.GlobalAveragePooling2D(name="avg_pool")(x)
    if dropout:
        x = keras.layers.Dropout(dropout, name="dropout")(x)
    logits = keras.layers.Dense(
        num_classes, kernel_regularizer=b.regularizer, dtype="float32", name="logits"
    )(x)
    name = "bn_inception" if batch_norm else "inception"
    return keras.Model(inputs, logits, name=name)
