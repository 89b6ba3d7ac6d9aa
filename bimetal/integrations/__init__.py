"""Other trainers running on bimetal's layout and back-ends (``bimetal.integrations.torchtitan``)."""
