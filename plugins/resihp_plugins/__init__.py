"""ResiHP package."""
