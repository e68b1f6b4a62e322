"""Collaborative attention (Cordonnier et al. 2020): re-parametrization and key width."""
