"""Bad input, told apart from a failure: input the user must fix (a config, data, a checkpoint, a flag, a
missing extra). Every entry point ends on it with one line naming the problem and the fix, and exit code 2
(`cli`); the packages below raise their own kinds of it."""

from __future__ import annotations


class BadInput(Exception):
    """Input that cannot be used, with the problem and the fix in the message; `kind` names it in the line
    printed (`<prog>: <kind> error: <message>`)."""

    kind = "input"
