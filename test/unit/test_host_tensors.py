"""utils/host_tensors.py: the per-step host helpers give what the torch calls they replace give."""

from __future__ import annotations

import torch

from radixserve.utils.host_tensors import inference_mode, int64_tensor


def test_int64_tensor_matches_torch_tensor():
    for values in ([], [0], [3, -1, 2**40], list(range(1000))):
        got = int64_tensor(values)
        assert got.dtype == torch.int64 and got.device.type == "cpu"
        assert torch.equal(got, torch.tensor(values, dtype=torch.int64))


def test_inference_mode_enters_only_when_needed():
    seen = []

    @inference_mode
    def probe(x: int) -> int:
        seen.append(torch.is_inference_mode_enabled())
        return x + 1

    assert probe(1) == 2  # entered here
    with torch.inference_mode():
        assert probe(2) == 3  # already in it
    with torch.inference_mode(False):
        assert probe(3) == 4
    assert seen == [True, True, True]
    assert not torch.is_inference_mode_enabled()
    assert probe.__name__ == "probe"
