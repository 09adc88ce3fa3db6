"""Start the server: load the model once, measure the policy's costs, listen."""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass

from specdraft.errors import SpecdraftError


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: str | None = None
    method: str = "plain"
    k: int = 8
    policy: str = "adaptive"
    options: tuple[tuple[str, str], ...] = ()
    dtype: str = "float32"
    device: str = "cpu"
    batch_invariant: bool = False
    max_batch: int = 16
    max_queue: int = 256
    context: int | None = None
    max_tokens_in_flight: int | None = None
    prefill_tokens: int = 512
    host: str = "127.0.0.1"
    port: int = 8000
    served_name: str | None = None
    log_level: str = "warning"
    shutdown_timeout: float = 60.0
    allow_reset: bool = False


def _require_server_packages() -> None:
    missing = []
    for name in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise SpecdraftError(f"specdraft serve needs {', '.join(missing)}: pip install 'specdraft[serve]'")


def build_state(cfg: ServeConfig, log=print):  # -> ServerState
    """Load the model, build the engine and scheduler, measure the cost model at the batch
    sizes the scheduler prices (adaptive speculation only)."""
    _require_server_packages()
    from specdraft.api import build_engine
    from specdraft.model.loader import load
    from specdraft.scheduler import Scheduler, SchedulerConfig
    from specdraft.server.app import ServerState

    sched_cfg = SchedulerConfig(max_batch=cfg.max_batch, max_queue=cfg.max_queue, row_capacity=cfg.context,
                                max_tokens_in_flight=cfg.max_tokens_in_flight, prefill_tokens=cfg.prefill_tokens)
    t0 = time.perf_counter()
    loaded = load(cfg.model, dtype=cfg.dtype, device=cfg.device, batch_invariant=cfg.batch_invariant)
    engine = build_engine(loaded, cfg.method, k=cfg.k, policy=cfg.policy, options=dict(cfg.options))
    log(f"specdraft serve: model {loaded.source.name} loaded in {time.perf_counter() - t0:.1f} s "
        f"({cfg.dtype}{', batch-invariant' if cfg.batch_invariant else ''}), method {cfg.method}")
    scheduler = Scheduler(engine, sched_cfg)
    if engine.speculative and engine.policy.config.kind == "adaptive":
        grid = sched_cfg.batch_grid
        log(f"specdraft serve: measuring the verification cost at batch sizes {', '.join(map(str, grid))} ...")
        t0 = time.perf_counter()
        for b in grid:
            engine.policy.prepare(b)
        log(f"specdraft serve: measured in {time.perf_counter() - t0:.1f} s")
    name = cfg.served_name or loaded.source.name.removesuffix(".gguf")
    return ServerState(scheduler, name, cfg.method, allow_reset=cfg.allow_reset)


def serve(cfg: ServeConfig) -> int:
    if not 0 <= cfg.port <= 65535:
        raise SpecdraftError(f"--port must be in 0..65535, got {cfg.port}")
    state = build_state(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    import uvicorn

    from specdraft.server.app import create_app

    app = create_app(state)
    print(f"specdraft serve: {state.model_id} ({cfg.method}) on http://{cfg.host}:{cfg.port}/v1 "
          f"(up to {cfg.max_batch} rows, {state.scheduler.row_capacity} tokens each, "
          f"{state.scheduler.max_tokens_in_flight} in flight)", file=sys.stderr, flush=True)
    # uvicorn handles SIGTERM itself (it stops accepting, lets requests in flight finish, runs
    # the shutdown), then restores the handler it found and raises the signal again: with this
    # one, that second delivery is a no-op and the process exits 0 after a clean shutdown
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                timeout_graceful_shutdown=cfg.shutdown_timeout)
    print("specdraft serve: stopped", file=sys.stderr, flush=True)
    return 0
