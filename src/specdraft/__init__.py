"""specdraft: speculative decoding for LLM text generation, without changing the output."""

__version__ = "0.1.0"

from specdraft.errors import SpecdraftError  # noqa: E402
from specdraft.sampling import Sampling  # noqa: E402

__all__ = ["Sampling", "SpecdraftError", "__version__", "load"]


def load(path=None, *, dtype="float32", device="cpu", batch_invariant=False, threads=None):  # type: ignore[no-untyped-def]
    """Load a model and its tokenizer (None = the embedded default model), with the command
    line's model options: ``dtype``, ``device``, ``batch_invariant`` (exact speculative output
    in any dtype) and ``threads`` (CPU threads for torch; None = torch's choice). See
    :func:`specdraft.model.loader.load`; build an engine with :func:`specdraft.api.build_engine`."""
    from specdraft.model.loader import load as _load, set_threads

    set_threads(threads)
    return _load(path, dtype=dtype, device=device, batch_invariant=batch_invariant)
