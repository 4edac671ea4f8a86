"""``example-mean-loss-empty``: the mean loss of an empty accumulation window is 0.0, not a crash.

Symptom: ``shim_example_pack.losses.mean_loss([])`` raises ``ZeroDivisionError`` when every sequence
of an accumulation window is masked out, and the run ends.

Fix: ``mean_loss`` is wrapped; an empty window returns 0.0 (and the shim counts the effect), every
other call is upstream's, untouched.

Limits: only ``mean_loss`` is fixed; a caller that divides by the window's length itself still fails.

This docstring is what ``python -m shim explain example-mean-loss-empty`` prints below the patch's
summary: a pack's patch is explained from its own text.
"""

from shim import Patch, Target, record_effect

NAME = "example-mean-loss-empty"


def _mean_loss(wrapped, instance, args, kwargs):
    losses = args[0] if args else kwargs.get("losses")
    if losses is not None and len(losses) == 0:
        record_effect(NAME, "returned 0.0 for an empty accumulation window (upstream divides by zero)")
        return 0.0
    return wrapped(*args, **kwargs)


def _bug_shows() -> bool:
    """The self-check ``python -m shim doctor`` runs: ``True`` when the bug shows (with the patch
    off, it should; with it on, it must not). It imports the target itself, when it runs."""
    from shim_example_pack import losses

    try:
        losses.mean_loss([])
    except ZeroDivisionError:
        return True
    return False


# The module stays light: it imports the shim only, never the library it patches, since the shim
# imports a pack's module when it starts (its targets are known only from here).
PATCH = Patch(
    name=NAME,
    summary="the mean loss of an empty accumulation window is 0.0 instead of ZeroDivisionError",
    # A real pack gates on the library it patches, e.g. distribution="transformers", requires=">=5.20,<5.26".
    distribution="shim-example-pack",
    requires="<0.2",  # the stand-in library "fixed it" in 0.2
    targets=(Target("shim_example_pack.losses:mean_loss", _mean_loss),),
    self_check=_bug_shows,
)
