"""The user's tools, built on the engine and never imported by it: the command line (``python -m
shim``, ``doctor``, ``explain``), the tables and the effects report, the help texts, and the
``shim-run`` launcher with its ``sitecustomize``.
"""
