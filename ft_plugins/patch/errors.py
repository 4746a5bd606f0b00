"""Why a patch run stopped; each error carries the ``ft-plugins`` exit code it maps to."""

from __future__ import annotations


class PatchError(Exception):
    """Base class; the message names the file or directory, what is wrong, and what to do."""

    exit_code = 1


class NotSuitable(PatchError):
    """The directory holds nothing a recipe covers, or a file does not match its recipe: nothing written."""

    exit_code = 3


class BadRequest(PatchError):
    """The command line asks for something that does not exist (unknown feature or target)."""

    exit_code = 2


class RecipeError(PatchError):
    """A recipe file shipped with ft_plugins is malformed: a defect of the package, not of the user's files."""

    exit_code = 1
