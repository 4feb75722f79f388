"""encode_values/decode_values (torch_ckpt.TypedValues): values stored as they are, typed, or pickled (opt-in)."""

from __future__ import annotations

import dataclasses
import enum
import pathlib
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch

from lightning_ckpt._load import decode_values, encode_values
from torch_ckpt import ConfigError, UnsafeCheckpointError


class Color(enum.IntEnum):
    RED = 1


def test_plain_values_are_kept_and_containers_copied():
    """Tensors, JSON scalars, numpy values, bytes, tuples and int-keyed dicts are kept, in copied containers."""
    t = torch.ones(2)
    ckpt = {"state_dict": OrderedDict(w=t), "opt": {0: {"betas": (0.9, 0.95)}}, "np": np.int64(3), "b": b"x",
            "none": None}
    out = encode_values(ckpt, "error")
    assert out["state_dict"]["w"] is t and out["opt"][0]["betas"] == (0.9, 0.95) and out["np"] == 3
    assert out["state_dict"] is not ckpt["state_dict"] and type(out["state_dict"]) is dict


def test_values_that_need_pickling_are_refused_naming_their_key():
    """A value without a typed encoding (a local namedtuple class) raises ConfigError naming the dotted key."""
    with pytest.raises(ConfigError, match=r"hyper_parameters\.extra"):
        encode_values({"hyper_parameters": {"extra": namedtuple("P", "a")(1)}}, "error")


class Opaque:
    """A plain object: only pickling stores it."""

    def __init__(self, a: int) -> None:
        self.a = a

    def __eq__(self, other: object) -> bool:
        return type(other) is Opaque and other.a == self.a


@dataclasses.dataclass
class Opts:
    root: pathlib.Path
    color: Color


@pytest.mark.parametrize("value", [pathlib.Path("/data"), pathlib.PurePosixPath("a/b"), Color.RED],
                         ids=["path", "pure-path", "int-enum"])
def test_paths_and_enums_round_trip_without_pickling(value):
    """Paths and enum members are stored under a marker (no pickle) and come back as equal, same-typed values."""
    out = decode_values(encode_values({"hyper_parameters": {"extra": value}}, "error"), allow_pickle=False)
    assert out["hyper_parameters"]["extra"] == value and type(out["hyper_parameters"]["extra"]) is type(value)


def test_dataclasses_are_stored_through_their_fields():
    """A dataclass hyper-parameter comes back as the same dataclass with its (decoded) fields, without pickling."""
    encoded = encode_values({"hp": {"opts": Opts(pathlib.Path("/d"), Color.RED)}}, "error")
    out = decode_values(encoded, allow_pickle=False)
    assert type(out["hp"]["opts"]) is Opts and out["hp"]["opts"] == Opts(pathlib.Path("/d"), Color.RED)


def test_pickle_mode_round_trips_when_unpickling_is_allowed():
    """With unsafe_values='pickle' the value comes back as the same object type when allowed."""
    out = decode_values(encode_values({"hp": {"root": Opaque(1)}}, "pickle"), allow_pickle=True)
    assert out["hp"]["root"] == Opaque(1)


def test_pickled_values_are_refused_without_opt_in():
    """Decoding pickled values without allow_pickle raises UnsafeCheckpointError naming the key."""
    encoded = encode_values({"hp": {"root": Opaque(1)}}, "pickle")
    with pytest.raises(UnsafeCheckpointError, match=r"hp\.root"):
        decode_values(encoded, allow_pickle=False)
