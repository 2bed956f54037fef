"""PreparedGemv batches (docs/formats/cpu-gemv.md, 'Arithmetic'): a batch of B x rows gives,
byte for byte, the B results of B batch-1 calls, on every kernel this CPU runs and every
format the prepared layout takes, for B = 1..9 (the AVX2 kernel takes nibble codes 4, 3,
2 rows per pass and a last single row alone; the AVX-512 one 1-8 rows per pass) and K an
odd number of groups. Inputs are fresh on every run; a failure names the seed."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv.quant as Q
from pagedkv.quant import prepared_gemv
from pagedkv.quant.formats import AFFINE, CODECS, Q4K, Q8

pytestmark = pytest.mark.filterwarnings("ignore:MQ2G256V2:UserWarning")

F32 = np.float32
FORMATS = sorted(c.name for c in CODECS.values() if c.kind in (AFFINE, Q8, Q4K))
ISAS = prepared_gemv.supported_isas()
CODECS_BY_NAME = {c.name: c for c in CODECS.values()}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("groups", [1, 3])           # K = G or 3 G: an odd number of groups
def test_a_batch_equals_its_rows_called_one_by_one(fmt, groups):
    seed = int(np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    m, k = 37, CODECS_BY_NAME[fmt].group_size * groups           # 3 tiles, the last of 5 rows
    w = rng.standard_normal((m, k)).astype(F32) * rng.uniform(0.01, 3, (m, 1)).astype(F32)
    raw = Q.quantize(w, fmt)
    gs = {isa: Q.prepare_gemv(raw, fmt, (m, k), isa=isa) for isa in ISAS}
    for batch in range(1, 10):
        x = (rng.standard_normal((batch, k)) * rng.uniform(0.1, 10, (batch, 1))).astype(F32)
        want = np.stack([gs["scalar"](x[b]) for b in range(batch)])   # the definition, row by row
        for isa, g in gs.items():
            got = g(x)
            assert got.shape == (batch, m)
            assert got.tobytes() == want.tobytes(), f"{fmt} {isa} B={batch} seed={seed}"
            for b in range(batch):
                assert g(x[b]).tobytes() == want[b].tobytes(), f"{fmt} {isa} B={batch} row {b} seed={seed}"

