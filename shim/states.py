"""The states a patch can be in, as ``shim.status()`` and ``python -m shim`` report them."""

APPLIED = "applied"  # its layers are in place (and act unless switched off)
PENDING = "pending"  # a target module is not imported yet: the patch applies right after it is
SKIPPED = "skipped"  # not needed or not safe here (outside its gate, target missing, shape changed)
DISABLED = "disabled"  # switched off: SHIM_DISABLE, shim.disable(), shim.deactivate(), shim.disabled()
FAILED = "failed"  # wrapping raised (and was rolled back), or a probe could not run

SUSPENDED_REASON = "inside shim.disabled()"
OFF_BY_API = "switched off with shim.disable()"
