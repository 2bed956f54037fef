# Fused dequant-GEMV over the affine and Q8F16 layouts (docs/contracts/hfqm-and-quant.md, '3.6 FWHT
# rotation' and '4. Weight codecs').
