"""HFQM container: mmap reader, streaming writer, quant-type register (hfqm-and-quant.md §1-2)."""

from pagedkv.hfqm.qtypes import QTYPES, QuantType, expected_nbytes, is_registered, qtype
from pagedkv.hfqm.reader import HfqmFile, TensorInfo, canonical_name
from pagedkv.hfqm.writer import HfqmWriter, PlannedTensor, plan_of
from pagedkv.hfqm.quantization_hash import compute_quantization_hash, verify_quantization_hash
from pagedkv.hfqm.mtp_bundle import write_mtp_bundle

__all__ = [
    "QTYPES", "QuantType", "expected_nbytes", "is_registered", "qtype",
    "HfqmFile", "TensorInfo", "canonical_name",
    "HfqmWriter", "PlannedTensor", "plan_of",
    "compute_quantization_hash", "verify_quantization_hash", "write_mtp_bundle",
]
