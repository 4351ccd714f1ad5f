"""The one exception ringseq raises for things the user can fix."""


class RingSeqError(ValueError):
    """A configuration, shape or model feature ringseq cannot handle exactly.

    The message always says what to change. ringseq raises this instead of computing
    something that differs from the unsplit model.
    """
