"""The tasks a vitattn model is trained for: a caption per image, or a class per image."""

__all__ = ["TASKS"]

TASKS = ("caption", "classification")
