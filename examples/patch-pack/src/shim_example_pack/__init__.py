"""An example patch pack for hf-train-shim.

``fixes`` declares the pack's patch; ``losses`` stands in for the library a real pack patches
(transformers, trl, peft, ...), so that the example runs anywhere, without torch.
"""

__version__ = "0.1.0"
