"""Paper reproductions, one folder each; `experiments.runner` launches their grids of runs."""
