"""What the patches' self-checks (``python -m shim doctor``) build and run, and the tests and the
benchmarks with them: tiny models (``models``) and the training steps taken on them (``steps``).
What only the tests build is in the repository's ``tests/tinymodels.py``, outside the wheel.
Nothing here runs at ``import shim``; torch and transformers are imported inside the functions.
"""
