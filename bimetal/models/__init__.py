"""bimetal.models."""
