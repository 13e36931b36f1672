import torch

import fzero


def test_nonfinite_leaves_names_the_culprits():
    tree = {"ok": torch.ones(3), "blocks": [{"w": torch.tensor([1.0, float("nan")])}, {"w": torch.tensor([float("-inf")])}]}
    assert fzero.nonfinite_leaves(tree) == ["blocks/0/w", "blocks/1/w"]
    assert fzero.nonfinite_leaves({"a": torch.zeros(2, dtype=torch.float16)}) == []
