# Sphinx + MyST: the docs are Markdown (readable on GitHub as they are) and the
# config lives inside docs/, which keeps the repository's top level fixed.
project = "pagedkv"
author = "pagedkv developers"
extensions = ["myst_parser"]
myst_enable_extensions = ["colon_fence"]
# GitHub-style heading anchors, so links like cli.md#pagedkv-demo work in both places.
myst_heading_anchors = 3
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "alabaster"
