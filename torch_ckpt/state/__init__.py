"""Training state: the state protocol save and restore accept, TrainState, optimizer state, RNG capture and the
loading of a state dict into live objects."""

from torch_ckpt.state._optim import OptimizerState
from torch_ckpt.state._protocol import Checkpointable, HasStateDict, StateToRestore, StateToSave
from torch_ckpt.state._train_state import TrainState

__all__ = ["Checkpointable", "HasStateDict", "StateToSave", "StateToRestore", "TrainState", "OptimizerState"]
