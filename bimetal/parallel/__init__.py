"""bimetal.parallel."""
