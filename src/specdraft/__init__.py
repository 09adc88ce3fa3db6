"""specdraft: speculative decoding for LLM text generation, without changing the output."""

__version__ = "0.1.0"

from specdraft.errors import SpecdraftError  # noqa: E402
from specdraft.sampling import Sampling  # noqa: E402

__all__ = ["Sampling", "SpecdraftError", "__version__", "load"]


def load(path=None, *, dtype="float32", device="cpu"):  # type: ignore[no-untyped-def]
    """Load a model and its tokenizer (None = the embedded default model). See
    :func:`specdraft.model.loader.load`."""
    from specdraft.model.loader import load as _load

    return _load(path, dtype=dtype, device=device)
