"""Reading a wrapped call's arguments by name or by position, whichever the caller used."""

_MISSING = object()


def argument(args: tuple, kwargs: dict, position: int, name: str, default=_MISSING):
    if name in kwargs:
        return kwargs[name]
    if len(args) > position:
        return args[position]
    if default is _MISSING:
        raise TypeError(f"missing argument {name!r}")
    return default


def leading_parameters(function, names: tuple[str, ...]):
    """``None`` when ``function``'s first parameters are ``names``; otherwise why not (for shape probes)."""
    import inspect

    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError) as exc:
        return f"cannot read the signature of {getattr(function, '__qualname__', function)}: {exc}"
    if tuple(parameters[: len(names)]) != names:
        return f"signature changed: {function.__qualname__}({', '.join(parameters)}) does not start with {names}"
    return None
