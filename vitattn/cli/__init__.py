"""Thin command-line entry points; the logic lives in the library.

Each imports torch and Lightning inside the function that needs them, so ``--help`` and usage errors are instant.
"""
