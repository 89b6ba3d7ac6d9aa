"""Error types shared by every layer.

``UserError`` is for mistakes a user can make (bad config, impossible layout, missing library): the
CLI prints its message as one sentence and exits with status 2, without a traceback. ``JobAborted`` is for
a job that stopped because a peer, a link or a collective failed: one sentence naming the rank, the step,
the phase and the group, exit status 1 (the launcher then restarts the job if it was asked to).
"""


class UserError(Exception):
    """An error the user caused and can fix; the message says what and how."""


class JobAborted(Exception):
    """The job cannot go on (a peer died or stalled, a link broke); the message says where."""
