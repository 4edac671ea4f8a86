"""A stand-in for an upstream library with a bug: what a real pack's patch targets lives in
transformers, trl or peft; this module plays their part in the example."""


def mean_loss(losses):
    """The mean of the losses of an accumulation window. The bug: an empty window (every sequence
    of the micro-batches masked out) raises ZeroDivisionError and ends the run."""
    return sum(losses) / len(losses)
