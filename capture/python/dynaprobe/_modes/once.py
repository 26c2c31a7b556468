"""Warnings a mode says once per module and topic: a checked call repeats every step, and so
would its warning."""

from __future__ import annotations

import warnings

# The stacklevel of a warning said during a checked call, counted from OnceWarnings through the
# phase (or a phase's helper) saying it and SinglePass._checked_call: it names a frame above the
# patched forward.
IN_CALL = 6


class OnceWarnings:
    """``warn(module, topic, message, stacklevel)`` says ``message`` the first time only."""

    def __init__(self):
        self.said: set = set()  # (module, topic)

    def __call__(self, module: str, topic: str, message: str, stacklevel: int = 5) -> None:
        if (module, topic) not in self.said:
            self.said.add((module, topic))
            warnings.warn(message, stacklevel=stacklevel)
