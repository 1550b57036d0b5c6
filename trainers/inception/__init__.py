"""The BN-Inception trainer's model, data, recipes and Table 2 driver (paper §4.2)."""
