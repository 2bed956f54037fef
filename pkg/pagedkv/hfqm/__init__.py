"""HFQM container: mmap reader, streaming writer, quant-type register (hfqm-and-quant.md §1-2)."""

from pagedkv.hfqm.qtypes import QTYPES, QuantType, expected_nbytes, is_registered, qtype

__all__ = ["QTYPES", "QuantType", "expected_nbytes", "is_registered", "qtype"]
