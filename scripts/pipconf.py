#!/usr/bin/env python3
"""pip's configuration, passed on to uv.

uv reads no pip configuration. A machine may give pip a wheel folder (``find-links``), extra
indexes, a constraint file or a certificate, in its config files or as ``PIP_*`` variables, and the
project must install from the same places with uv as with pip, without writing any of the
machine's paths into the project. So the scripts ask pip itself (``python3 -m pip config list``,
which shows the config files' entries and the ``PIP_*`` variables alike) and this script turns the
answer into uv's arguments and environment, as bash to ``eval``::

    eval "$(python3 scripts/pipconf.py)"   # sets PIP_UV_ARGS=(...) and exports SSL_CERT_FILE etc.

pip's own precedence holds: a ``PIP_*`` variable over the ``[install]`` section over ``[global]``.
Run it alone to see what it passes on.
"""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys

#: pip option -> uv option, for options that take a list (pip splits the value on whitespace).
LISTS = {
    "find-links": "--find-links",
    "extra-index-url": "--extra-index-url",
    "constraint": "--constraints",
    "trusted-host": "--allow-insecure-host",
}
#: pip option -> uv option, for options with one value.
SINGLE = {"index-url": "--index-url"}
#: pip option -> uv flag, for yes/no options.
FLAGS = {"no-index": "--no-index"}
#: pip option -> environment variables uv reads instead.
ENVIRONMENT = {
    "cert": ("SSL_CERT_FILE",),
    "timeout": ("UV_HTTP_TIMEOUT",),
    "default-timeout": ("UV_HTTP_TIMEOUT",),
    "proxy": ("HTTPS_PROXY", "HTTP_PROXY"),
}
#: pip options that do not change what gets installed from where: nothing to pass on.
IRRELEVANT = {
    "disable-pip-version-check",
    "no-cache-dir",
    "cache-dir",
    "progress-bar",
    "quiet",
    "verbose",
    "no-color",
    "no-input",
    "retries",
    "log",
    "root-user-action",
    "break-system-packages",
    "no-warn-script-location",
    "user",
}
#: Sections in pip's order of precedence, lowest first (pip's ConfigOptionParser).
SECTIONS = ("global", "install", ":env:")


def parse(listing: str) -> dict[str, str]:
    """``pip config list`` output -> {option: value}, pip's precedence applied."""
    found: dict[str, dict[str, str]] = {section: {} for section in SECTIONS}
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        section, dot, option = key.rpartition(".")
        if not sep or not dot or section not in found:
            continue
        try:
            text = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            text = value
        if str(text).strip():
            found[section][option.replace("_", "-")] = str(text)
    merged: dict[str, str] = {}
    for section in SECTIONS:
        merged.update(found[section])
    return merged


def is_true(value: str) -> bool:
    return value.strip().lower() in ("1", "y", "yes", "t", "true", "on")


def uv_settings(options: dict[str, str]) -> tuple[list[str], dict[str, str], list[str]]:
    """(uv arguments, environment variables, pip options that are not passed on)."""
    args: list[str] = []
    env: dict[str, str] = {}
    left: list[str] = []
    for option, value in options.items():
        if option in LISTS:
            for item in value.split():
                args += [LISTS[option], item]
        elif option in SINGLE:
            args += [SINGLE[option], value.strip()]
        elif option in FLAGS:
            if is_true(value):
                args.append(FLAGS[option])
        elif option in ENVIRONMENT:
            for name in ENVIRONMENT[option]:
                env[name] = value.strip()
        elif option not in IRRELEVANT:
            left.append(option)
    return args, env, left


def bash(args: list[str], env: dict[str, str]) -> str:
    lines = ["PIP_UV_ARGS=(" + " ".join(shlex.quote(a) for a in args) + ")"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    return "\n".join(lines)


def main() -> int:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    args, env, left = uv_settings(parse(listing))
    for option in left:
        print(f"pipconf: pip's option {option!r} is not passed on to uv", file=sys.stderr)
    print(bash(args, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
