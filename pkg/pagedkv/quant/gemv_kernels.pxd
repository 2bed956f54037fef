# Fused dequant-GEMV over the affine and Q8F16 layouts (hfqm-and-quant.md §3.6, §4).
