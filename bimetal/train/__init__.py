"""bimetal.train."""
