# Q8F16 weight codec (qt 3, hfqm-and-quant.md §4.5): f16 scale + 32 int8 per block.
