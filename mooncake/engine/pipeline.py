"""Chunked pipeline parallelism (CPP, paper §5.1): one prefill across X processes.

The model's layers are split into X contiguous stages, one process each
(torch.distributed: gloo on CPU, NCCL on GPU). The prompt is cut into chunks
that flow through the stages: stage s receives chunk k's hidden states from
stage s − 1, runs its layers — attending to the KV of the earlier chunks, which
it keeps for its own layers — sends the result on to stage s + 1 without
waiting for it to be received, and starts chunk k + 1. So stage 1 computes
chunk k + 1 while stage 2 computes chunk k; the last stage turns the final
chunk's last hidden state into logits.

Unlike tensor parallelism, stages exchange only one activation per chunk
boundary (no all-reduce per layer), which is why the paper prefers CPP for long
prompts across nodes.

Invariants: each stage holds exactly the weights of its layers in the whole
model (per-layer seeds); the result equals a single process's forward pass.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket
from typing import Any

import torch

from mooncake._checks import require_int
from mooncake.engine.attention import prefill_attention_into
from mooncake.engine.config import ModelConfig
from mooncake.engine.model import LlamaModel
from mooncake.errors import ConfigError, EngineError, InvalidRequestError

__all__ = ["PipelineGroup", "stage_layers"]


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """The contiguous layers of `stage` when `num_layers` are split as evenly as possible."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _stage_main(
    rank: int,
    world: int,
    config: ModelConfig,
    options: dict[str, Any],
    inbox: Any,
    outbox: Any,
) -> None:
    """A stage process: build its layers, then run jobs from `inbox` until None."""
    import torch.distributed as dist

    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", options["interface"])
        torch.set_num_threads(options["threads"])
        device = torch.device(options["device"], rank) if options["device"] == "cuda" else torch.device("cpu")
        dist.init_process_group(options["backend"], init_method=options["init_method"], rank=rank, world_size=world)
        layers = stage_layers(config.num_layers, world, rank)
        model = LlamaModel(config, seed=options["seed"], dtype=options["dtype"], device=device, layers=layers)
        outbox.put(("ready", rank))
    except BaseException as error:  # report, so the driver does not wait for a dead stage
        outbox.put(("error", f"stage {rank} failed to start: {error!r}"))
        return
    chunk = options["chunk_tokens"]
    with torch.inference_mode():
        while True:
            job = inbox.get()
            if job is None:
                break
            try:
                ids = torch.tensor(job, dtype=torch.long)
                n = ids.shape[0]
                shape = (n, config.num_kv_heads, config.head_dim)
                kv = [
                    (
                        torch.empty(shape, dtype=model.dtype, device=device),
                        torch.empty(shape, dtype=model.dtype, device=device),
                    )
                    for _ in model.layers
                ]
                sends = []
                x = torch.empty(0)
                for start in range(0, n, chunk):
                    end = min(n, start + chunk)
                    if rank == 0:
                        x = model.embed(ids[start:end])
                    else:
                        x = torch.empty((end - start, config.hidden_size), dtype=model.dtype, device=device)
                        dist.recv(x, src=rank - 1)
                    cos, sin = model.rope(torch.arange(start, end))
                    for (k_all, v_all), layer in zip(kv, model.layers, strict=True):
                        x = layer(x, cos, sin, prefill_attention_into(k_all, v_all, start, end))
                    if rank < world - 1:
                        sends.append(dist.isend(x.contiguous(), dst=rank + 1))  # on to the next stage; keep going
                for send in sends:
                    if send is not None:
                        send.wait()
                if rank == world - 1:
                    outbox.put(("logits", model.logits(x[-1:])[0].cpu().numpy()))
            except BaseException as error:
                outbox.put(("error", f"stage {rank} failed: {error!r}"))
                break
    dist.destroy_process_group()


class PipelineGroup:
    """X stage processes that prefill prompts together with chunked pipeline parallelism.

    Args:
        config: the model's shape.
        num_stages: X, the processes (at most the number of layers).
        chunk_tokens: tokens per pipeline chunk.
        seed, dtype: the weights (as `LlamaModel`).
        device: "cpu" (gloo) or "cuda" (NCCL, stage s on GPU s).
        threads_per_stage: torch threads in each stage (default: the CPUs shared out).
        interface: the network interface gloo uses (loopback for one machine).
        timeout_s: how long to wait for the stages to start and to answer.

    Raises:
        ConfigError: bad options. EngineError: a stage failed to start.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_stages: int,
        chunk_tokens: int = 512,
        seed: int = 0,
        dtype: str = "float32",
        device: str = "cpu",
        threads_per_stage: int | None = None,
        interface: str = "lo",
        timeout_s: float = 120.0,
    ) -> None:
        require_int("num_stages", num_stages, minimum=1)
        require_int("chunk_tokens", chunk_tokens, minimum=1)
        if num_stages > config.num_layers:
            raise ConfigError(f"num_stages={num_stages} exceeds the model's {config.num_layers} layers")
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.config, self.num_stages, self.timeout_s = config, num_stages, timeout_s
        threads = threads_per_stage or max(1, (os.cpu_count() or 1) // num_stages)
        options = {
            "seed": seed,
            "dtype": dtype,
            "device": device,
            "chunk_tokens": chunk_tokens,
            "threads": threads,
            "interface": interface,
            "backend": "nccl" if device == "cuda" else "gloo",
            "init_method": f"tcp://127.0.0.1:{_free_port()}",
        }
        context = multiprocessing.get_context("spawn")  # fork would copy this process's torch threads
        self._inboxes = [context.Queue() for _ in range(num_stages)]
        self._outbox = context.Queue()
        self._processes = [
            context.Process(
                target=_stage_main,
                args=(rank, num_stages, config, options, self._inboxes[rank], self._outbox),
                name=f"cpp-stage-{rank}",
                daemon=True,
            )
            for rank in range(num_stages)
        ]
        for process in self._processes:
            process.start()
        try:
            for _ in range(num_stages):
                kind, payload = self._receive()
                if kind != "ready":
                    raise EngineError(str(payload))
        except BaseException:
            self.close()
            raise

    def prefill(self, tokens: list[int]) -> torch.Tensor:
        """Run `tokens` through the pipeline: float32 logits [vocab] at the last position.

        Raises:
            InvalidRequestError: no tokens or ids outside the vocabulary.
            EngineError: a stage failed or did not answer within the timeout.
        """
        if not tokens:
            raise InvalidRequestError("a prompt needs at least one token")
        if min(tokens) < 0 or max(tokens) >= self.config.vocab_size:
            raise InvalidRequestError(f"token ids must lie in [0, {self.config.vocab_size})")
        for inbox in self._inboxes:
            inbox.put(list(tokens))
        kind, payload = self._receive()
        if kind != "logits":
            raise EngineError(str(payload))
        return torch.from_numpy(payload)

    def _receive(self) -> tuple[str, Any]:
        try:
            return self._outbox.get(timeout=self.timeout_s)  # type: ignore[no-any-return]
        except queue.Empty:
            dead = [p.name for p in self._processes if not p.is_alive()]
            raise EngineError(
                f"the pipeline did not answer within {self.timeout_s} s (stopped stages: {dead})"
            ) from None

    def close(self) -> None:
        """Stop every stage process (waits briefly, then terminates)."""
        for inbox, process in zip(self._inboxes, self._processes, strict=True):
            if process.is_alive():
                inbox.put(None)
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)

    def __enter__(self) -> PipelineGroup:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
