# Raw half-precision weights (qt 1 F16, qt 16 BF16; docs/contracts/hfqm-and-quant.md, '3.2 f32 to
# f16 by truncation' and '4.6 Raw types (qt 1, 2, 16, 22)').
