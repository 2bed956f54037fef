"""Tiny reference transformer used for parity (paged == flat, restored == fresh) and the demo."""
