"""What the patches' self-checks (``python -m shim doctor``), the tests and the benchmarks build and
run: tiny models (``models``) and the training steps taken on them (``steps``). Nothing here runs
at ``import shim``; torch and transformers are imported inside the functions.
"""
