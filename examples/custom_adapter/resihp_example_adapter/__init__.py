"""A minimal ResiHP adapter plugin (see README.md)."""
