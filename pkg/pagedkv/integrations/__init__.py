"""pagedkv inside other inference engines.

Each submodule adapts pagedkv to one engine and imports that engine itself, so ``import
pagedkv`` never does: :mod:`pagedkv.integrations.mlx_lm` is the prompt cache of mlx-lm
(``pip install "pagedkv[mlx-lm]"``; docs/integrations/mlx-lm.md).
"""
