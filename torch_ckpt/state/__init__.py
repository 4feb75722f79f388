"""Training state: TrainState, optimizer state, RNG capture and the loading of a state dict into live objects."""
