"""TrainState construction checks for dataloaders."""

import pytest
import torch

from torch_ckpt import ConfigError, TrainState


def test_plain_dataloader_is_refused_with_advice():
    """A torch DataLoader (no state_dict) is refused, naming torchdata's StatefulDataLoader."""
    with pytest.raises(ConfigError, match="StatefulDataLoader"):
        TrainState(dataloader=torch.utils.data.DataLoader(list(range(4))))


def test_plain_random_sampler_warns_that_resume_is_inexact():
    """A StatefulDataLoader over torch's RandomSampler warns; torchdata's sampler does not."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    data = list(range(8))
    with pytest.warns(UserWarning, match="resumed run will see different batches"):
        TrainState(dataloader=StatefulDataLoader(data, sampler=torch.utils.data.RandomSampler(data)))
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*resumed run.*")
        TrainState(dataloader=StatefulDataLoader(data, sampler=RandomSampler(data)))
