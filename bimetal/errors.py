"""Error types shared by every layer.

``UserError`` is for mistakes a user can make (bad config, impossible layout, missing library): the
CLI prints its message as one sentence and exits with status 2, without a traceback.
"""


class UserError(Exception):
    """An error the user caused and can fix; the message says what and how."""
