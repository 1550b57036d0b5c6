"""Which engine runs a trainer: TensorFlow (tf.distribute) or JAX (keras.distribution)."""
