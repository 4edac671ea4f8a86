"""What the patches' bug probes (``Patch.bug_probe``: ``python -m shim doctor`` asks them, and the
engine where a release cannot vouch for its code) build: bare transformers models and layers, made
from the modules already imported, without a config (``bare``). The tiny models the tests and the
benchmarks train are in the repository's ``tests/tinymodels.py``, outside the wheel. Nothing here
runs at ``import shim``; torch and transformers are taken from ``sys.modules`` inside the functions.
"""
