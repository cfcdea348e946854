"""The rewriter's errors a user can cause, in the room every other room may import."""


class CaptureError(ValueError):
    """The model or step cannot be captured (not compiled, open dimensions, no loss...)."""
