"""The BN-Inception trainer's model, data, recipes, training task and Table 2 (paper §4.2)."""
