"""Exceptions and warnings the shim raises or emits."""


class PatchError(RuntimeError):
    """A patch could not be applied and the user asked for strict mode (``SHIM_STRICT=1``).

    Outside strict mode the same problem is only logged and shown by ``python -m shim``.
    """


class ShimWarning(UserWarning):
    """A configuration problem the shim worked around (bad environment value, shadowed package)."""
