"""bimetal.plan."""
