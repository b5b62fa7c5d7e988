"""The one base of every mistake a user can fix (a config, a path, data, a checkpoint, a request).

Its message is the whole story: what is wrong and what would be right. The command line prints it
as one line, without a traceback. It lives apart from the modules that raise it so that catching it
imports nothing heavy: a refused command answers before torch has loaded."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix, said in one sentence."""
