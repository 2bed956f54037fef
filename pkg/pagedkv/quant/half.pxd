# Raw half-precision weights (qt 1 F16, qt 16 BF16; hfqm-and-quant.md §3.2, §4.6).
