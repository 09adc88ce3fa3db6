"""User-facing errors.

A :class:`SpecdraftError` is a user mistake or a bad input (missing file, unsupported
architecture, invalid sampling values...). Its message is one line that says what is
wrong and, where possible, what to do. The CLI prints it without a traceback.
"""


class SpecdraftError(Exception):
    """A user mistake or bad input, reported as one line."""


class ModelFileError(SpecdraftError):
    """A model file or folder is missing, truncated or corrupt."""


class UnsupportedModelError(SpecdraftError):
    """The model's architecture or a feature of it is not supported."""


class ContextOverflowError(SpecdraftError):
    """A prompt (plus the tokens to generate) does not fit the context or the cache."""


class SamplingError(SpecdraftError):
    """Invalid sampling settings."""


class VocabularyMismatchError(SpecdraftError):
    """A draft model whose vocabulary or special tokens differ from the target's."""
