"""The benchmark's reference kernel (hip/bench.hip): the streaming-read probe must read
every byte it is timed on."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import errors
from pagedkv.bench import gpu

RNG = np.random.default_rng()


@pytest.mark.gpu
@pytest.mark.parametrize(("n_vec", "blocks"), [(1, 3), (4099, 7), (1 << 20, 1056)])
def test_gpu_read_probe_sums_every_word(device, n_vec, blocks):
    data = RNG.integers(0, 2**32, 4 * n_vec, dtype=np.uint32)
    sums = device.array(np.full(blocks, 0xDEADBEEF, np.uint32))  # every block must write
    gpu.read_probe(device, device.array(data), sums)
    got = int(sums.to_numpy().sum(dtype=np.uint64)) % 2**32
    assert got == int(data.sum(dtype=np.uint64)) % 2**32


@pytest.mark.gpu
def test_gpu_read_probe_refuses_partial_vectors(device):
    sums = device.array(np.zeros(4, np.uint32))
    with pytest.raises(errors.InvalidArgument, match="need whole 16-byte vectors"):
        gpu.read_probe(device, device.empty(24, np.uint8), sums)
    assert (sums.to_numpy() == 0).all()
