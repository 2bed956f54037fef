"""HFQM container: mmap reader, streaming writer, quant-type register
(docs/contracts/hfqm-and-quant.md, '1. Quick reference' to '2. HFQM v1 container')."""

from pagedkv.hfqm.mtp_bundle import write_mtp_bundle
from pagedkv.hfqm.quantization_hash import compute_quantization_hash, verify_quantization_hash
from pagedkv.hfqm.reader import HfqmFile, TensorInfo, canonical_name
from pagedkv.hfqm.writer import HfqmWriter, PlannedTensor, plan_of
from pagedkv.quant.qtypes import QTYPES, QuantType, expected_nbytes, is_registered, qtype

__all__ = [
    "QTYPES",
    "HfqmFile",
    "HfqmWriter",
    "PlannedTensor",
    "QuantType",
    "TensorInfo",
    "canonical_name",
    "compute_quantization_hash",
    "expected_nbytes",
    "is_registered",
    "plan_of",
    "qtype",
    "verify_quantization_hash",
    "write_mtp_bundle",
]
