# Q8F16 weight codec (qt 3, docs/contracts/hfqm-and-quant.md, '4.5 Q8F16 (qt 3)'): f16 scale + 32
# int8 per block.
