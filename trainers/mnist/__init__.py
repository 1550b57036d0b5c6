"""The sigmoid MNIST trainer's network, data, training task and report (paper §4.1, Fig. 1)."""
