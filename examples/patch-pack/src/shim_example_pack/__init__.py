"""An example patch pack for hf-train-shim: one patch of transformers, found through an entry point.

``fixes`` declares it (``PATCH``); ``pyproject.toml`` names it in the entry-point group
``hf_train_shim.patches``.
"""

__version__ = "0.1.0"
