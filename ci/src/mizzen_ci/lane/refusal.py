"""The one way a GPU lane says no before running anything.

Invariant: a :class:`LaneRefusal` message says why the lane must not run here or with this input
and what to do instead; the command exits 2 with it, having run nothing.
"""


class LaneRefusal(Exception):
    """The lane must not run here or with this input; the message says why and what to do."""
