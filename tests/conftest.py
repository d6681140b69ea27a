"""Test-wide settings."""

from hypothesis import settings

# Property tests check behaviour, not speed: on a loaded CI machine a single example can
# take longer than hypothesis' default 200 ms deadline without anything being wrong.
settings.register_profile("resihp", deadline=None)
settings.load_profile("resihp")
