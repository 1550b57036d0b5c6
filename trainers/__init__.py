"""absl trainers reproducing the experiments of Ioffe & Szegedy (2015)."""
