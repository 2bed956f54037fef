"""HFQM container: mmap reader, streaming writer, quant-type register (hfqm-and-quant.md §1-2)."""
