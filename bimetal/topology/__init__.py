"""bimetal.topology."""
