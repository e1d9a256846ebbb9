"""Thin command-line entry points; the logic lives in the library."""
