"""The one base of every mistake a user can fix (a config, a path, data, a checkpoint, a request).

Its message is the whole story: what is wrong and what would be right. The command line prints it
as one line, without a traceback. It lives apart from the modules that raise it so that catching it
imports nothing heavy: a refused command answers before torch has loaded."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix, said in one sentence."""


class Stopped(Exception):
    """A command that ended early but cleanly, when asked to (a scheduler's signal); the message
    says how to continue, and `code` is the exit status to end with."""

    code = 1
