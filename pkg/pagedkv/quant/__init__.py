"""Weight codecs (HFQ/MQ/Q8), FWHT-256 and KV-cache quantization (hfqm-and-quant.md §3-6)."""
