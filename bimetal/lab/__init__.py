"""bimetal.lab."""
