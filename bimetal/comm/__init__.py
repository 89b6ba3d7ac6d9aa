"""bimetal.comm."""
