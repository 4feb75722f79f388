"""The distributed context: rank, world size and the private checkpoint process groups."""
