"""Tests of torch_ckpt.format._files: tensors split from JSON values, types preserved."""

import json

import numpy as np
import pytest
import torch

from torch_ckpt.errors import ConfigError
from torch_ckpt.format._files import join_state, split_state


def roundtrip(state, **kw):
    tensors, tree = split_state(state, **kw)
    tree = json.loads(json.dumps(tree))
    return tensors, join_state(tree, tensors)


def test_tensors_use_dcp_dotted_keys():
    """Nested dict tensors get DCP's dot-joined flat keys."""
    t = torch.ones(2)
    tensors, _ = split_state({"model": {"fc.weight": t}, "optim": {"state": {"fc.weight": {"exp_avg": t}}}})
    assert set(tensors) == {"model.fc.weight", "optim.state.fc.weight.exp_avg"}


def test_python_types_survive_json():
    """int, float, bool, None, str, tuple, int-keyed dict, nan and inf keep their type and value."""
    state = {"i": 3, "f": 0.1, "b": True, "n": None, "s": "x", "t": (1, (2, 3)), "d": {1: "a", 2: [1.5]},
             "nan": float("nan"), "inf": float("-inf"), "l": [1, 2]}
    _, out = roundtrip(state)
    assert type(out["i"]) is int and out["i"] == 3
    assert out["t"] == (1, (2, 3)) and isinstance(out["t"][1], tuple)
    assert out["d"] == {1: "a", 2: [1.5]}
    assert out["nan"] != out["nan"] and out["inf"] == float("-inf")
    assert out["b"] is True and out["n"] is None and out["l"] == [1, 2]


def test_numpy_values_roundtrip():
    """numpy arrays and scalars come back with dtype and value."""
    arr = np.arange(6, dtype=np.uint32).reshape(2, 3)
    _, out = roundtrip({"a": arr, "s": np.float32(1.5)})
    assert out["a"].dtype == np.uint32 and (out["a"] == arr).all()
    assert out["s"].dtype == np.float32 and out["s"] == np.float32(1.5)


def test_rank_local_tensors_are_inlined():
    """Tensors under rank-local keys go into the JSON tree, not to DCP."""
    rng = torch.get_rng_state()
    tensors, out = roundtrip({"rng": {"cpu": rng}, "w": torch.zeros(1)}, rank_local_keys=("rng",))
    assert set(tensors) == {"w"}
    assert torch.equal(out["rng"]["cpu"], rng) and out["rng"]["cpu"].dtype == torch.uint8


def test_dict_shaped_like_a_tag_is_escaped():
    """A user dict whose only key looks like an internal tag is not mistaken for one."""
    _, out = roundtrip({"x": {"__tuple__": [1]}})
    assert out == {"x": {"__tuple__": [1]}}


def test_unsupported_value_names_the_key():
    """An object that would need pickling is rejected with its key path."""
    with pytest.raises(ConfigError, match="extras.fn"):
        split_state({"extras": {"fn": object()}})


def test_flattening_collision_is_rejected():
    """Two paths flattening to the same DCP key raise instead of silently overwriting."""
    with pytest.raises(ConfigError, match="a.b"):
        split_state({"a": {"b": torch.zeros(1)}, "a.b": torch.zeros(1)})


# -- exact types or a refusal (issue 13 item 4) -----------------------------------------------------
def _json_roundtrip(value):
    """Encode ``{"v": value}``, write it as the persist step does, read it back and decode."""
    tensors, tree = split_state({"v": value})
    text = json.dumps(tree, separators=(",", ":"), allow_nan=True)
    return join_state(json.loads(text), tensors)["v"]


def _same_bits(a, b) -> bool:
    return np.asarray(a).tobytes() == np.asarray(b).tobytes()


_NP_SCALARS = [np.bool_(True), np.int8(-3), np.uint8(250), np.int16(-300), np.uint16(60000), np.int32(-7),
               np.uint32(4_000_000_000), np.int64(-2**62), np.uint64(2**64 - 1), np.longlong(5), np.ulonglong(6),
               np.float16(0.1), np.float32(1.5), np.float64(0.1), np.longdouble("1.1"), np.float32("nan"),
               np.float64("-inf"), np.complex64(1 + 2j), np.complex128(-1.5j), np.clongdouble(3 + 4j),
               np.str_("héllo"), np.bytes_(b"ab\x00c"), np.datetime64("2020-01-02T03:04:05.123456789", "ns"),
               np.datetime64("2020-01-01", "D"), np.datetime64("NaT"), np.timedelta64(7, "s"),
               np.timedelta64("NaT", "ms")]


@pytest.mark.parametrize("value", _NP_SCALARS, ids=lambda v: f"{type(v).__name__}-{v.dtype}")
def test_numpy_scalars_keep_their_exact_type_and_bits(value):
    """Every numpy scalar dtype comes back as the same numpy type with the same bits (np.str_ is not str)."""
    out = _json_roundtrip(value)
    assert type(out) is type(value) and out.dtype == value.dtype and _same_bits(out, value)


_ARRAYS = [np.arange(6, dtype=np.uint32).reshape(2, 3), np.array(5), np.array([1.5, np.nan], dtype=">f8"),
           np.array(["a", "bcd"]), np.array([b"x", b"yz\x00"]), np.array(["2020-01-01", "NaT"], dtype="M8[D]"),
           np.array([3, 4], dtype="m8[us]"), np.asfortranarray(np.arange(6.0).reshape(2, 3)), np.zeros((0, 3)),
           np.array([1 + 2j], dtype=np.complex64), np.array([True, False]), np.array(7, dtype=np.float16)]


@pytest.mark.parametrize("value", _ARRAYS, ids=lambda a: f"{a.dtype}-{a.shape}")
def test_numpy_arrays_keep_dtype_shape_and_values(value):
    """Arrays keep dtype (byte order included), shape (0-d included) and every value."""
    out = _json_roundtrip(value)
    assert type(out) is np.ndarray and out.dtype == value.dtype and out.shape == value.shape
    assert _same_bits(out, np.ascontiguousarray(value))


@pytest.mark.parametrize("value", [
    1, -(2**70), 2**5000, 0.1, -0.0, True, None, "", "\ud800", 1 + 2j, b"\x00\xff", bytearray(b"ab"),
    (1, [2, (3,)]), [], (), {1, "a", (1, 2)}, frozenset({b"x", 2.5}),
], ids=lambda v: f"{type(v).__name__}{sorted(v, key=repr)}" if isinstance(v, (set, frozenset)) else repr(v))
def test_python_values_keep_their_exact_type_and_value(value):
    """Big ints, complex, bytes vs bytearray, tuple vs list, sets and frozensets come back as they were."""
    out = _json_roundtrip(value)
    assert type(out) is type(value) and out == value
    if isinstance(value, float):
        assert str(out) == str(value)  # -0.0 keeps its sign


def test_dict_keys_keep_their_exact_type():
    """Non-str keys (int, None, tuple, float, bytes, bool, np.str_, numpy ints) come back with their type."""
    value = {1: "a", None: 2, (1, 2): 3, 1.5: 4, b"k": 5, np.str_("s"): 6, np.int64(3): 7, False: 8}
    out = _json_roundtrip(value)
    assert list(out) == list(value) and [type(k) for k in out] == [type(k) for k in value]
    assert list(out.values()) == list(value.values())


def test_dict_with_several_tag_like_keys_is_escaped():
    """A user dict that has an internal tag among several keys is not decoded as that tag."""
    value = {"__ndarray_b64__": "AAAA", "dtype": "<f8", "shape": [1]}
    assert _json_roundtrip(value) == value


def test_ordered_dict_comes_back_as_an_ordered_dict_with_the_same_order():
    """OrderedDict (a module's state_dict) comes back as an OrderedDict, same keys, same order (issue 26 item 6)."""
    from collections import OrderedDict

    out = _json_roundtrip(OrderedDict([("b", 1), ("a", 2)]))
    assert type(out) is OrderedDict and list(out.items()) == [("b", 1), ("a", 2)]
    nested = _json_roundtrip({"o": OrderedDict([((1, 2), OrderedDict(z=1))]), "d": {"__odict__": 1}})
    assert type(nested["o"]) is OrderedDict and type(nested["o"][(1, 2)]) is OrderedDict
    assert nested["d"] == {"__odict__": 1} and type(nested["d"]) is dict


def test_set_encoding_does_not_depend_on_iteration_order():
    """Equal sets encode identically (every rank writes the same tree)."""
    assert split_state({"s": {3, "x", 1}})[1] == split_state({"s": {"x", 1, 3}})[1]


def _refused_values():
    import dataclasses
    import datetime
    import enum
    from collections import defaultdict, namedtuple
    from pathlib import Path

    class Color(enum.Enum):
        RED = 1

    class Level(enum.IntEnum):
        LOW = 1

    @dataclasses.dataclass
    class Config:
        lr: float = 0.1

    class MyStr(str):
        pass

    return {
        "object-array": (np.array([None, 0.5]), "object array"),
        "structured-array": (np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]), "structured"),
        "masked-array": (np.ma.array([1, 2]), "np.asarray"),
        "numpy-void": (np.zeros(1, dtype="V4")[0], "numpy scalar"),
        "enum": (Color.RED, ".value"),
        "int-enum": (Level.LOW, ".value"),
        "path": (Path("/data"), "str(path)"),
        "dataclass": (Config(), "asdict"),
        "namedtuple": (namedtuple("P", "x y")(1, 2), "_asdict"),
        "defaultdict": (defaultdict(int), "plain builtin"),
        "str-subclass": (MyStr("x"), "plain builtin"),
        "datetime": (datetime.datetime(2020, 1, 1), "plain Python values"),
        "object": (object(), "plain Python values"),
        "tensor-dict-key": ({torch.zeros(1): 1}, "as keys"),
    }


@pytest.mark.parametrize("name", list(_refused_values()))
def test_values_without_an_exact_encoding_are_refused_naming_key_and_remedy(name):
    """Enums, paths, dataclasses, namedtuples, subclasses, object/structured arrays... raise ConfigError naming keys."""
    value, remedy = _refused_values()[name]
    with pytest.raises(ConfigError, match="state key 'cfg.v") as info:
        split_state({"cfg": {"v": value}})
    assert remedy in str(info.value)


def _refused_tensors():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "sparse-coo": (torch.eye(3).to_sparse(), "sparse"),
            "sparse-csr": (torch.eye(3).to_sparse_csr(), "sparse"),
            "quantized": (torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8), "quantized"),
            "nested": (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
            "meta": (torch.empty(2, device="meta"), "meta"),
            "sub-byte": (torch.zeros(2, dtype=torch.uint8).view(torch.bits8), "dtype torch.bits8"),
            "subclass": (torch.ones(2).as_subclass(type("MyTensor", (torch.Tensor,), {})), "tensor subclass"),
        }


@pytest.mark.parametrize("name", list(_refused_tensors()))
@pytest.mark.parametrize("rank_local", [False, True], ids=["dcp", "rank-local"])
def test_tensors_dcp_cannot_store_exactly_are_refused(name, rank_local):
    """Sparse, quantized, nested, meta, raw-bit and subclass tensors raise ConfigError naming the key."""
    value, what = _refused_tensors()[name]
    with pytest.raises(ConfigError, match="state key 'rng.t'") as info:
        split_state({"rng": {"t": value}}, rank_local_keys=("rng",) if rank_local else ())
    assert what in str(info.value) or (rank_local and "rank-local" in str(info.value))


def test_parameters_are_accepted_as_tensors():
    """nn.Parameter (state_dict(keep_vars=True)) goes to DCP like a plain tensor."""
    p = torch.nn.Parameter(torch.ones(2))
    tensors, _ = split_state({"w": p})
    assert tensors["w"] is p


def test_container_that_contains_itself_is_refused():
    """A self-referencing list raises ConfigError naming the key instead of recursing forever."""
    loop = [1]
    loop.append(loop)
    with pytest.raises(ConfigError, match="contains itself"):
        split_state({"a": loop})


def test_nesting_deeper_than_the_limit_is_refused():
    """A state nested deeper than MAX_DEPTH raises ConfigError, not RecursionError in the writer."""
    from torch_ckpt.format._files import MAX_DEPTH

    deep: dict = {}
    node = deep
    for _ in range(MAX_DEPTH + 1):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(ConfigError, match="nested deeper"):
        split_state(deep)


def test_old_format_nodes_still_decode():
    """Trees written before the exact encodings (plain JSON keys in __dict__, value numpy scalars) still load."""
    tree = {"d": {"__dict__": [[1, "a"], [None, 2]]}, "s": {"__np_scalar__": 1.5, "dtype": "<f4"}}
    out = join_state(tree, {})
    assert out == {"d": {1: "a", None: 2}, "s": np.float32(1.5)} and type(out["s"]) is np.float32


def test_malformed_tagged_node_is_a_corrupt_checkpoint():
    """A tag with a value of the wrong shape raises CheckpointCorruptError, not TypeError."""
    from torch_ckpt.errors import CheckpointCorruptError

    with pytest.raises(CheckpointCorruptError):
        join_state({"c": {"__complex__": 3}}, {})
