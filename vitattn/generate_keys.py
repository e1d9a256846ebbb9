"""The names of ``ImageCaptioner.generate``'s decoding settings, shared by every entry point and report.

Kept apart from the model so that a command line can be checked without importing torch.
"""

__all__ = ["GENERATE_KEYS", "SAMPLING_KEYS", "SEARCH_KEYS"]

# deterministic: greedy or beam search
SEARCH_KEYS = ("num_beams", "max_new_tokens", "length_penalty", "early_stopping")
SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p")
GENERATE_KEYS = SEARCH_KEYS + SAMPLING_KEYS
