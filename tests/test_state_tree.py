"""torch_ckpt.format._files: the walker of encoded per-rank trees (leaves found, malformed nodes named by path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_ckpt.format._files import MAX_NDIM, embedded_info, split_state, tensor_keys, walk_tree
from torch_ckpt.storage._locations import Malformed


def encoded():
    """An encoded tree holding every kind of leaf (from the real encoder)."""
    state = {"model": {"w": torch.ones(2), "b": torch.zeros(1)}, "rng": torch.zeros(3, dtype=torch.uint8),
             "step": 3, "pair": (1, b"ab"), "arr": np.arange(3), "f": float("nan"), 7: "int key"}
    return split_state(state, rank_local_keys=("rng",))[1]


def test_leaves_are_classified():
    """DCP placeholders, embedded tensors and arrays are told apart from plain values."""
    kinds = {".".join(path): kind for path, kind, _ in walk_tree(encoded())}
    assert kinds["model.w"] == "tensor" and kinds["rng"] == "inline" and kinds["arr"] == "ndarray"
    assert kinds["step"] == "value" and kinds["pair.1"] == "value" and kinds["f"] == "value"
    assert kinds["7"] == "value"


def test_tensor_keys_are_the_dcp_placeholders():
    """tensor_keys gives exactly the keys of the DCP tensors the tree refers to."""
    assert tensor_keys(encoded()) == {"model.w", "model.b"}


def test_leaves_come_in_document_order():
    """Leaves are yielded in the order of the tree (list items and dict keys in order)."""
    paths = [".".join(p) for p, _, _ in walk_tree({"a": [1, 2], "b": {"c": 3}})]
    assert paths == ["a.0", "a.1", "b.c"]


def test_deeply_nested_tree_does_not_exhaust_the_stack():
    """A tree nested 5000 lists deep (beyond the recursion limit) is walked iteratively (no RecursionError)."""
    tree: list = [1]
    for _ in range(5000):
        tree = [tree]
    assert [kind for _, kind, _ in walk_tree(tree)] == ["value"]


@pytest.mark.parametrize("node,message", [
    ({"__tensor__": 5}, "is not a key"),
    ({"__tensor_b64__": "AAAA", "dtype": "uint8", "shape": [4]}, "holds 3 bytes"),
    ({"__tensor_b64__": "AAAA", "dtype": "no_such", "shape": [3]}, "unsupported tensor dtype"),
    ({"__tensor_b64__": "A!AA", "dtype": "uint8", "shape": [3]}, "not base64"),
    ({"__tensor_b64__": "", "dtype": "uint8", "shape": [-1]}, "invalid shape"),
    ({"__tensor_b64__": "", "dtype": "uint8", "shape": [1] * (MAX_NDIM + 1)}, "invalid shape"),
    ({"__ndarray_b64__": "AAAA", "dtype": "O", "shape": [1]}, "unsupported array dtype"),
    ({"__np_scalar__": "x", "dtype": "<i4"}, "invalid numpy scalar"),
    ({"__np_scalar__": 1 << 40, "dtype": "<i2"}, "invalid numpy scalar"),
    ({"__bytes_b64__": "abc"}, "not base64"),
    ({"__float__": "nope"}, "invalid float"),
    ({"__float__": 1.0}, "invalid float"),
    ({"__tuple__": 3}, "malformed __tuple__"),
    ({"__dict__": [[1, 2, 3]]}, "malformed __dict__"),
    ({"__dict__": [[[1], 2]]}, "malformed __dict__"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_malformed_node_is_named_by_its_path(node, message):
    """A malformed node raises Malformed naming its dotted path and the problem."""
    with pytest.raises(Malformed, match=rf"^model\.layers\.1: .*{message}"):
        list(walk_tree({"model": {"layers": [0, node]}}))


def test_malformed_root_is_named_root():
    """A malformed node at the top is named <root>."""
    with pytest.raises(Malformed, match="^<root>: "):
        list(walk_tree({"__float__": "nope"}))


def test_encoded_dict_key_is_validated_too():
    """A dict key that is itself an encoded value (bytes) is checked like any value."""
    with pytest.raises(Malformed, match="not base64"):
        list(walk_tree({"__dict__": [[{"__bytes_b64__": "!!"}, 1]]}))


def test_embedded_info_gives_shape_dtype_and_bytes():
    """embedded_info reports the shape, dtype name and byte count of a valid embedded tensor and array."""
    assert embedded_info("inline", {"__tensor_b64__": "AAAAAAAA", "dtype": "float16", "shape": [1, 3]}) == \
        ([1, 3], "float16", 6)
    assert embedded_info("ndarray", {"__ndarray_b64__": "AAAAAA==", "dtype": "<i2", "shape": [2]}) == \
        ([2], "int16", 4)


def test_embedded_tensor_dtype_must_be_a_torch_dtype_name():
    """A torch attribute that is not a dtype (a function name) is refused as a dtype."""
    with pytest.raises(Malformed, match="unsupported tensor dtype"):
        embedded_info("inline", {"__tensor_b64__": "", "dtype": "zeros", "shape": [0]})
