"""The sigmoid MNIST trainer's model, data and report (paper §4.1, Figure 1)."""
