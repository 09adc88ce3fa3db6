"""Training drafters on the target's own outputs: prompts (:mod:`.prompts`) and
self-distillation data (:mod:`.data`). Imports the model and engine, never ``bench`` or the CLI."""
