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


def _draws() -> tuple:
    import random

    import numpy as np

    return random.random(), float(np.random.rand()), torch.rand(1).item()


def test_state_dict_does_not_advance_any_rng():
    """Capturing the state (RNG included) leaves Python, NumPy and torch generators where they were."""
    torch.manual_seed(0)
    state = TrainState(model=torch.nn.Linear(2, 2))
    import random

    import numpy as np

    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = _draws()
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    state.state_dict()
    assert _draws() == expected


@pytest.mark.parametrize("consumed", [0, 2])
def test_state_dict_does_not_advance_the_dataloader(consumed):
    """Capturing a StatefulDataLoader's position (before or during an epoch) does not change the batches that follow."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    def batches(capture: bool) -> list:
        data = list(range(12))
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(3))
        loader = StatefulDataLoader(data, batch_size=2, sampler=sampler)
        state = TrainState(dataloader=loader, rng=False)
        it = iter(loader)
        out = [next(it).tolist() for _ in range(consumed)]
        if capture:
            state.state_dict()
        out += [b.tolist() for b in it]
        return out

    assert batches(capture=True) == batches(capture=False)
