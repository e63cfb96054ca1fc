"""The one exception type for mistakes a user can make.

Anything the user controls (config values, paths, mesh sizes, tokenizer files, checkpoints)
raises `TitanliteError` with a message that names the field or file and what is wrong.
The entry point turns it into a single line on rank 0 and exit code 2; every other
exception is a bug and keeps its traceback.
"""


class TitanliteError(Exception):
    """A problem with the user's input, reported as one line and exit code 2."""


USER_ERROR_EXIT_CODE = 2
