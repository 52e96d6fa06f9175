"""Chunked pipeline parallelism (CPP, paper §5.1): one prefill across X processes.

The model's layers are split into X contiguous stages (`stage_layers`). The
calling process is stage 0, the group's driver: it embeds the tokens, runs the
first layers and holds the KV of the whole prompt; stages 1 … X − 1 are
processes it spawns, linked by torch.distributed (gloo on CPU, NCCL on GPU) on
127.0.0.1. The prompt is cut into chunks that flow through the stages: stage s
receives chunk k's hidden states from stage s − 1, runs its layers —
attending to the KV of the earlier chunks, which it keeps for its own layers —
sends the result on to stage s + 1 without waiting for it to be received, and
starts chunk k + 1. So stage 1 computes chunk k + 1 while stage 2 computes
chunk k; the last stage turns the final chunk's last hidden state into logits.

A prefill may start after a cached prefix of p tokens: the driver sends each
stage its layers' prefix KV (rows 0 … p − 1) first, and the chunks cover rows
p … n − 1 only. Once a stage has computed its last chunk it sends the KV of its
layers' new rows back to the driver, so the driver ends with every layer's KV
of the prompt — what a prefill node stores in its cache and streams to a decode
node. The KV travels back rather than each stage writing the node's (shared
memory) cache pages itself because only the driver's process owns the cache:
its index, pins and reservations, and prefix blocks on a lower tier (SSD) that
only it can read. With one writer, a page the cache gives back after a failure
can never be written by a stage still running. The price is one copy of each
stage's KV over loopback per prefill, small beside the compute that made it.

Unlike tensor parallelism, stages exchange only one activation per chunk
boundary (no all-reduce per layer), which is why the paper prefers CPP for long
prompts across nodes.

Failures: every tensor moves with the group's timeout, so a stage that dies
fails the driver's next transfer at once (its connection closes) and one that
stops answering fails it after `timeout_s`; either is an `EngineError`, and the
group is failed from then on (its streams are out of step) and ends its
stages. So is an error of stage 0's own work mid-job (its layers, an
interrupt): the other stages are left waiting mid-job. The failure names its
cause, not whoever noticed it first: a stage process that a signal ended or
stopped, else the stage at the end of a chain of timeouts (a stage's report
names the peer it waited on: "stage 2 timed out receiving from stage 1"), else
a stage's own error. A stage that fails or exits while the stages start or
connect fails the group's construction at once, naming it and its error
(torch's own rendezvous would wait `timeout_s` for it). The caller's own code
is not the group's failure: `on_rows` errors are raised once the job is done,
and a failing cancel flag stops every stage in step, as a cancel does. A watch
thread notices a stage process that exits, ends the others (a
transfer the driver is waiting on fails at once) and calls `on_failure` — after
a failed transfer too, whose ended stages it sees exit. A stage exits when its
job channel or its connections to the driver break, and a parent watch ends
it within `PARENT_WATCH_S` of its driver's process exiting, however it exits.
The rendezvous store and the links listen on 127.0.0.1 only and, like
torch.distributed's own, carry no authentication.

Cancellation: `prefill(..., cancelled=flag)` asks the flag at stage 0 before
each chunk, and a go flag travels the pipe ahead of every chunk (each stage
takes it from the one before and passes it on), so every stage stops at the
same chunk; none sends KV or logits back, the driver raises `Cancelled`, and
the links stay in step for the next prefill.

Invariants: each stage holds exactly the weights of its layers in the whole
model (per-layer seeds); the logits and every layer's KV equal a single
process's forward pass over the same prefix; a stage process runs only while
the group is open and has not failed.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any

import torch

from mooncake._checks import require_int, require_number, shown
from mooncake.engine.attention import prefill_attention_into
from mooncake.engine.config import ModelConfig, check_callback, check_instance
from mooncake.engine.model import LlamaModel, token_ids
from mooncake.errors import Cancelled, ConfigError, EngineError, InvalidRequestError
from mooncake.sched.cost import DEFAULT_CHUNK_TOKENS

__all__ = ["PARENT_WATCH_S", "PipelineGroup", "stage_layers"]

PARENT_WATCH_S = 0.2  # how often a stage checks that its driver's process lives
_PREFIX, _HIDDEN, _KV, _LOGITS, _GO = 1, 2, 3, 4, 5  # message tags: one stream per kind between two stages

OnRows = Callable[[int, int, int], None]


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """The contiguous layers of `stage` when `num_layers` are split as evenly as possible: the first
    `num_layers % num_stages` stages hold one layer more (ceil), the rest floor(num_layers / num_stages).

    Raises:
        ConfigError: `num_layers` < 1, `num_stages` outside [1, num_layers] (a stage holds at least one layer),
            or `stage` outside [0, num_stages), naming the field and its value.
    """
    require_int("num_layers", num_layers, minimum=1)
    require_int("num_stages", num_stages, minimum=1, below=num_layers + 1)
    require_int("stage", stage, minimum=0, below=num_stages)
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def _process_group(store: Any, rank: int, world: int, device: str, timeout_s: float) -> Any:
    """This process's end of the group's links, every operation bounded by `timeout_s`."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if device == "cuda":
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, nccl_options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # links on loopback only
    return dist.ProcessGroupGloo(store, rank, world, options)


class _LinkError(RuntimeError):
    """A transfer between stage `rank` and stage `peer` failed; `timed_out`: it waited the group's whole timeout
    (the peer stopped answering), else the link broke (the peer's process ended, say)."""

    def __init__(self, rank: int, peer: int, action: str, error: BaseException) -> None:
        # gloo says "Timed out waiting …" when a wait ran out; a closed or reset connection says so instead.
        self.peer, self.timed_out = peer, "timed out" in str(error).lower()
        super().__init__(f"stage {rank} {'timed out' if self.timed_out else 'failed'} {action} stage {peer}: {error}")


def _wait(work: Any, rank: int, peer: int, action: str) -> None:
    """Wait for a transfer of stage `rank`'s with stage `peer`; its failure a `_LinkError` naming both."""
    try:
        work.wait()
    except RuntimeError as error:
        raise _LinkError(rank, peer, action, error) from error


class _FlagFailed(Exception):
    """The caller's cancel flag raised `error`; every stage stopped at the same chunk (the links are in step)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(repr(error))
        self.error = error


def _run_chunks(
    model: LlamaModel,
    links: Any,
    rank: int,
    world: int,
    ids: torch.Tensor | None,
    rows: tuple[int, int, int],
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    on_rows: OnRows | None,
    cancelled: Callable[[], bool] | None = None,
) -> tuple[torch.Tensor, int | None]:
    """One stage's part of a prefill: rows [p, n) chunk by chunk through its layers; the last chunk's output, and
    None, or where the prefill was cancelled (the row it stopped at: the output is not the last chunk's).

    `rows` is (p, n, chunk_tokens); `kv` holds this stage's layers' buffers, rows [0, p) filled. Before each
    chunk a go flag travels the pipe ahead of it: stage 0 sets it from `cancelled` (asked there only), each later
    stage takes it from the stage before and passes it on, so every stage stops at the same chunk. A flag that
    raises stops the stages as a cancel does, then its error is raised as `_FlagFailed` (the links stay in
    step: not a link's failure).
    """
    prefix, n, chunk = rows
    sent: list[tuple[Any, torch.Tensor]] = []  # each send with its tensor, alive until it is on its way
    x = torch.empty(0)
    stopped: int | None = None
    raised: BaseException | None = None
    for start in range(prefix, n, chunk):
        end = min(n, start + chunk)
        if rank == 0:
            try:
                proceed = not (cancelled is not None and cancelled())
            except BaseException as error:  # the caller's flag failed: stop every stage first, then say so
                proceed, raised = False, error
            go = torch.tensor([int(proceed)], dtype=torch.int64, device=model.device)
        else:
            go = torch.empty(1, dtype=torch.int64, device=model.device)
            _wait(links.recv([go], rank - 1, _GO), rank, rank - 1, "receiving from")
            proceed = bool(go.item())
        if rank < world - 1:
            sent.append((links.send([go], rank + 1, _GO), go))
        if not proceed:
            stopped = start
            break
        if ids is not None:
            x = model.embed(ids[start:end])
        else:
            x = torch.empty((end - start, model.config.hidden_size), dtype=model.dtype, device=model.device)
            _wait(links.recv([x], rank - 1, _HIDDEN), rank, rank - 1, "receiving from")
        cos, sin = model.rope(torch.arange(start, end))
        for index, (layer, (k_all, v_all)) in enumerate(zip(model.layers, kv, strict=True)):
            x = layer(x, cos, sin, prefill_attention_into(k_all, v_all, start, end))
            if on_rows is not None:
                on_rows(model.first_layer + index, start, end)
        if rank < world - 1:
            x = x.contiguous()
            sent.append((links.send([x], rank + 1, _HIDDEN), x))  # on to the next stage; keep going
    for work, _tensor in sent:
        _wait(work, rank, rank + 1, "sending to")
    if raised is not None:
        raise _FlagFailed(raised)
    return x, stopped


def _shown(value: object) -> str:
    """A value as an error names it: a tensor by its shape, dtype and device (never its numbers), anything else
    by its repr (a sequence by its length and kind)."""
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} {value.dtype} tensor on {value.device}"
    if isinstance(value, Sequence) and not isinstance(value, str):
        return f"a {type(value).__name__} of {len(value)}"
    return shown(value)


def _is_stopped(pid: int | None) -> bool:
    """Whether process `pid` is stopped by a signal (Linux's /proc; False where there is none to read)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")  # the state follows the name
    except (OSError, IndexError):
        return False


def _watch_parent(parent_pid: int) -> None:
    """End this stage process once its driver's process is gone (whatever killed it)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_WATCH_S)
        os._exit(1)

    threading.Thread(target=watch, name="driver-watch", daemon=True).start()


def _serve_job(model: LlamaModel, links: Any, rank: int, world: int, job: tuple[int, int, int]) -> None:
    """A stage's part of one prefill: its prefix KV in, its chunks through, its new KV (and logits) out."""
    prefix, n, _chunk = job
    config = model.config
    shape = (n, config.num_kv_heads, config.head_dim)
    kv = [
        (
            torch.empty(shape, dtype=model.dtype, device=model.device),
            torch.empty(shape, dtype=model.dtype, device=model.device),
        )
        for _ in model.layers
    ]
    if prefix:
        given = torch.empty(
            (len(kv), 2, prefix, config.num_kv_heads, config.head_dim), dtype=model.dtype, device=model.device
        )
        _wait(links.recv([given], 0, _PREFIX), rank, 0, "receiving from")
        for (k_all, v_all), (k_prefix, v_prefix) in zip(kv, given, strict=True):
            k_all[:prefix] = k_prefix
            v_all[:prefix] = v_prefix
    x, stopped = _run_chunks(model, links, rank, world, None, job, kv, None)
    if stopped is not None:  # cancelled at stage 0: no KV or logits go back (the driver waits for none)
        return
    new = torch.stack([torch.stack((k_all[prefix:], v_all[prefix:])) for k_all, v_all in kv])
    sends = [links.send([new], 0, _KV)]
    if rank == world - 1:
        logits = model.logits(x[-1:])[0].contiguous()
        sends.append(links.send([logits], 0, _LOGITS))
    for work in sends:
        _wait(work, rank, 0, "sending to")


def _stage_main(rank: int, world: int, config: ModelConfig, options: dict[str, Any], inbox: Any, outbox: Any) -> None:
    """A stage process (rank >= 1): build its layers, join the links, then serve jobs from `inbox` until None.

    `inbox` and `outbox` are pipe ends (no named semaphores to leak when a process is killed).
    """
    import torch.distributed as dist

    _watch_parent(options["parent_pid"])
    try:
        torch.set_num_threads(options["threads"])
        device = torch.device(options["device"], rank) if options["device"] == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL works on the current device
        layers = stage_layers(config.num_layers, world, rank)
        model = _stage_model(config, options, device, layers)
        outbox.send(("built", rank))
        timeout = datetime.timedelta(seconds=options["start_timeout_s"])
        address = ("127.0.0.1", options["port"])
        store = dist.TCPStore(*address, world, is_master=False, timeout=timeout)  # type: ignore[attr-defined]
        links = _process_group(store, rank, world, options["device"], options["timeout_s"])
    except BaseException as error:  # report, so the driver does not wait for a dead stage
        with contextlib.suppress(OSError):
            outbox.send(("error", f"stage {rank} failed to start: {shown(error, limit=400)}", None, False))
        return
    with torch.inference_mode():
        while True:
            try:
                job = inbox.recv()  # idle here, outside any timed transfer
            except (EOFError, OSError):  # the driver is gone (its parent watch would end us too)
                break
            if job is None:
                break
            try:
                _serve_job(model, links, rank, world, job)
            except BaseException as error:
                # Leaving closes this stage's links: whoever waits on it fails at once rather than at the timeout.
                # A link's failure names the peer, so that the driver can blame a stalled stage, not this one.
                report: tuple[str, str, int | None, bool]
                if isinstance(error, _LinkError):
                    report = ("error", str(error), error.peer, error.timed_out)
                else:
                    report = ("error", f"stage {rank} failed: {shown(error, limit=400)}", None, False)
                with contextlib.suppress(OSError):
                    outbox.send(report)
                os._exit(1)


def _stage_model(config: ModelConfig, options: dict[str, Any], device: torch.device, layers: range) -> LlamaModel:
    """A stage's layers: read from the checkpoint when the group serves one, else seeded random weights."""
    if options["checkpoint"] is not None:
        from mooncake.engine.checkpoint import load_model

        return load_model(options["checkpoint"], dtype=options["dtype"], device=device, layers=layers)
    return LlamaModel(config, seed=options["seed"], dtype=options["dtype"], device=device, layers=layers)


class PipelineGroup:
    """X stage processes that prefill prompts together with chunked pipeline parallelism.

    This process is stage 0 and drives the group (`model` holds its layers);
    stages 1 … X − 1 are processes it starts. One prefill runs at a time.

    Args:
        config: the model's shape.
        num_stages: X, the processes (at most the number of layers).
        chunk_tokens: tokens per pipeline chunk.
        seed, dtype: the weights (as `LlamaModel`).
        checkpoint: a checkpoint directory (`config` is its `read_model_config`): each stage reads its own
            layers' tensors with `load_model` instead of drawing seeded weights (`seed` is then unused).
        device: "cpu" (gloo) or "cuda" (NCCL, stage s on GPU s: at least `num_stages` GPUs).
        threads_per_stage: torch threads in each started stage, at least 1 (default: the CPUs shared out);
            stage 0 runs on the caller's threads.
        timeout_s: how long any one transfer between stages may wait.
        start_timeout_s: how long to wait for the stages to build their layers, and then to connect.
        on_failure: called once, from a watch thread, with the reason, when the group fails while open: a
            stage process exited, or a transfer failed (and the group ended its stages).

    Invariants:
        `check_invariants()`: the stages cover the layers in order; while the group is open and has not
        failed every stage process runs; once closed, none does.

    Raises:
        ConfigError: bad options (a `config` that is no `ModelConfig`, an `on_failure` that cannot be called),
            naming the field and value. EngineError: a stage failed or exited while the
            stages started or connected (naming it and its error), or they did not within `start_timeout_s`.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_stages: int,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        seed: int = 0,
        dtype: str = "float32",
        checkpoint: str | None = None,
        device: str = "cpu",
        threads_per_stage: int | None = None,
        timeout_s: float = 120.0,
        start_timeout_s: float = 120.0,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        check_instance("config", config, ModelConfig, error=ConfigError, optional=False)
        require_int("num_stages", num_stages, minimum=1)
        require_int("chunk_tokens", chunk_tokens, minimum=1)
        check_callback("on_failure", on_failure, error=ConfigError)  # else a TypeError on the watch thread
        if num_stages > config.num_layers:
            raise ConfigError(f"num_stages={num_stages} exceeds the model's {config.num_layers} layers")
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {shown(device)}")
        if device == "cuda" and torch.cuda.device_count() < num_stages:  # stage s runs on GPU s
            raise ConfigError(
                f"device='cuda' puts stage s on GPU s: num_stages={num_stages} needs as many GPUs, "
                f"torch finds {torch.cuda.device_count()}"
            )
        if threads_per_stage is not None:  # checked here, not by a stage process seconds after it was spawned
            threads_per_stage = require_int("threads_per_stage", threads_per_stage, minimum=1)
        # Finite: an infinite wait overflows the store's timedelta once its socket is open (and hangs otherwise).
        timeout_s = require_number("timeout_s", timeout_s, minimum=0, strict=True)
        start_timeout_s = require_number("start_timeout_s", start_timeout_s, minimum=0, strict=True)
        self.start_timeout_s = start_timeout_s
        self.config, self.num_stages, self.chunk_tokens, self.timeout_s = config, num_stages, chunk_tokens, timeout_s
        self._on_failure = on_failure
        self._lock = threading.Lock()  # one prefill at a time: the links are streams
        self._closing = threading.Event()
        self._failure: str | None = None
        self._failed = threading.Lock()  # makes the first failure the one recorded and reported
        # Each stage's account of its failure: (text, the peer whose link failed or None, whether it timed out).
        self._reports: dict[int, tuple[str, int | None, bool]] = {}
        # The watch thread and a failed prefill both read the stages' reports and reap exited stages: one at a
        # time, else one reaps a stage (waitpid) while the other reads no exit code for it.
        self._reading = threading.RLock()
        self._gone: set[int] = set()  # stages whose report pipe has closed: they are exiting
        self._processes: list[Any] = []
        self._inboxes: list[Any] = []  # the driver's ends of the pipes to and from each stage
        self._outboxes: list[Any] = []
        self._links: Any = None
        self._store: Any = None
        self._watch: threading.Thread | None = None
        home = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        options: dict[str, Any] = {"seed": seed, "dtype": dtype, "checkpoint": checkpoint}
        self.model = _stage_model(config, options, home, stage_layers(config.num_layers, num_stages, 0))
        if num_stages == 1:
            return
        import torch.distributed as dist

        listener = socket.create_server(("127.0.0.1", 0))  # the store would listen on every interface by itself
        port = int(listener.getsockname()[1])
        timeout = datetime.timedelta(seconds=start_timeout_s)
        self._store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1",
            port,
            num_stages,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
            use_libuv=True,
        )
        if threads_per_stage is None:
            threads_per_stage = max(1, (os.cpu_count() or 1) // num_stages)
        options |= {
            "device": device,
            "threads": threads_per_stage,
            "port": port,
            "timeout_s": timeout_s,
            "start_timeout_s": start_timeout_s,
            "parent_pid": os.getpid(),
        }
        context = multiprocessing.get_context("spawn")  # fork would copy this process's torch threads
        theirs = []
        for rank in range(1, num_stages):
            job_reader, job_writer = context.Pipe(duplex=False)
            report_reader, report_writer = context.Pipe(duplex=False)
            self._inboxes.append(job_writer)
            self._outboxes.append(report_reader)
            theirs.append((job_reader, report_writer))
            self._processes.append(
                context.Process(
                    target=_stage_main,
                    args=(rank, num_stages, config, options, job_reader, report_writer),
                    name=f"cpp-stage-{rank}",
                    daemon=True,
                )
            )
        try:
            for process, ends in zip(self._processes, theirs, strict=True):
                process.start()
                for end in ends:
                    end.close()  # the stage's now: its death closes them
            self._await_built()  # a stage that cannot start says so before the rendezvous
            self._links = self._connect(device, timeout_s)
        except BaseException:
            self.close()
            raise
        self._watch = threading.Thread(target=self._watch_stages, name="cpp-stage-watch", daemon=True)
        self._watch.start()

    # ------------------------------------------------------------------ prefill

    @property
    def failure(self) -> str | None:
        """Why the group failed, or None while it works."""
        return self._failure

    @property
    def pids(self) -> tuple[int, ...]:
        """The process ids of stages 1 … X − 1 (stage 0 is this process)."""
        return tuple(int(p.pid) for p in self._processes if p.pid is not None)

    @torch.inference_mode()
    def prefill(
        self,
        tokens: Sequence[int],
        *,
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
        prefix_tokens: int = 0,
        on_rows: OnRows | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """Run `tokens` through the pipeline after a cached prefix: float32 logits [vocab] at the last position.

        Args:
            tokens: the whole prompt.
            kv: K and V buffers per layer of the whole model, each `[len(tokens), kv_heads, head_dim]` in the
                model's dtype on stage 0's device; rows [0, prefix_tokens) hold the prefix's KV, and on return
                every row holds the prompt's KV (default: scratch buffers, prefix_tokens must be 0).
            prefix_tokens: leading tokens whose KV is given (fewer than the prompt's).
            on_rows: called as `on_rows(layer, start, end)` once rows [start, end) of `layer` are final in
                `kv`, on this thread: stage 0's layers chunk by chunk as they are computed, the other stages'
                once their KV has arrived (start = prefix_tokens). Its first error is raised after the group
                has finished the prefill (the group stays usable).
            cancelled: asked by stage 0 before each chunk; True stops every stage at that chunk (the group stays
                usable; of `kv`, stage 0's layers hold the rows of the chunks done).

        Raises:
            InvalidRequestError: no tokens, ids outside the vocabulary, more tokens than the model's
                `max_context_tokens`, a prefix not shorter than the prompt, `kv` that is no sequence of
                `num_layers` (K, V) pairs of tensors of the shape, dtype and device above, or an `on_rows` or
                `cancelled` that cannot be called: each naming the argument, before any stage hears of the job
                (the group stays usable).
            EngineError: the group is closed (checked first: no failure is recorded), or a stage failed or did not
                answer within the timeout (the group has failed).
            Cancelled: `cancelled` answered True.
        """
        if self._closing.is_set():  # else the closed job pipe's OSError, taken for a failed transfer
            raise EngineError("the pipeline group is closed")
        ids = token_ids(tokens, self.config.vocab_size)
        n = len(ids)
        self.model.config.check_context_tokens(n)  # the loaded checkpoint's bound, before any stage hears of the job
        # An integer, checked before any stage hears of the job (a float would fail them in `range`).
        prefix_tokens = require_int("prefix_tokens", prefix_tokens, minimum=0, error=InvalidRequestError)
        if not 0 <= prefix_tokens < n or (kv is None and prefix_tokens):
            raise InvalidRequestError(f"prefix_tokens={prefix_tokens} must lie in [0, {n}) and come with its KV")
        kv = self._buffers(n) if kv is None else self._checked_kv(kv, n)
        for name, callback in (("on_rows", on_rows), ("cancelled", cancelled)):
            check_callback(name, callback, error=InvalidRequestError)  # else a TypeError mid-job, failing the group
        errors: list[BaseException] = []

        def listen(layer: int, start: int, end: int) -> None:
            if on_rows is not None and not errors:
                try:
                    on_rows(layer, start, end)
                except Exception as error:  # the stages are mid-job: finish it, then raise
                    errors.append(error)

        with self._lock:
            if self._failure is not None:
                raise EngineError(f"the pipeline group has failed: {self._failure}")
            try:
                logits = self._drive(ids, prefix_tokens, kv, listen, cancelled)
            except _FlagFailed as failed:  # the caller's flag: every stage stopped in step, the group is sound
                raise failed.error from None
            except Cancelled:
                raise
            except (RuntimeError, OSError) as error:  # a link closed or timed out, or a stage's pipe broke
                own = error if isinstance(error, _LinkError) else None
                self._fail(self._blame(f"a transfer between stages failed: {error}", own))
                raise EngineError(f"the pipeline group failed: {self._failure}") from error
            except BaseException as error:  # stage 0's own work failed mid-job: the other stages wait mid-job
                self._fail(f"stage 0 failed mid-job: {shown(error, limit=400)}")
                raise
        if errors:
            raise errors[0]
        return logits.float().cpu()

    def _checked_kv(self, kv: object, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`kv` as a list of `num_layers` (K, V) pairs of `n`-row buffers (the caller's own tensors, written in
        place), or an InvalidRequestError naming it and what is wrong: checked whole before any stage hears of the
        job, where a malformed pair (a triple, a number) would fail stage 0's unpacking mid-job, and the group."""
        model, layers = self.model, self.config.num_layers
        shape = (n, self.config.num_kv_heads, self.config.head_dim)
        wanted = f"kv must be a sequence of {layers} (K, V) pairs of {shape} {model.dtype} tensors on {model.device}"
        if not isinstance(kv, Sequence) or len(kv) != layers:
            raise InvalidRequestError(f"{wanted}, got {_shown(kv)}")
        expected = (shape, model.dtype, model.device)
        pairs = []
        for layer, pair in enumerate(kv):
            tensors = tuple(pair) if isinstance(pair, Sequence) else ()
            if len(tensors) != 2:
                raise InvalidRequestError(f"{wanted}, got {_shown(pair)} at layer {layer}")
            for t in tensors:
                if not isinstance(t, torch.Tensor) or (tuple(t.shape), t.dtype, t.device) != expected:
                    raise InvalidRequestError(f"{wanted}, got {_shown(t)} at layer {layer}")
            pairs.append((tensors[0], tensors[1]))
        return pairs

    def _buffers(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (n, self.config.num_kv_heads, self.config.head_dim)
        model = self.model
        return [
            (
                torch.empty(shape, dtype=model.dtype, device=model.device),
                torch.empty(shape, dtype=model.dtype, device=model.device),
            )
            for _ in range(self.config.num_layers)
        ]

    def _drive(
        self,
        ids: torch.Tensor,
        prefix: int,
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        on_rows: OnRows,
        cancelled: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """Stage 0's part: start the job on every stage, run its chunks, gather the other stages' KV and the logits."""
        n, world, links = ids.shape[0], self.num_stages, self._links
        job = (prefix, n, self.chunk_tokens)
        sent: list[tuple[Any, int, torch.Tensor]] = []
        for rank in range(1, world):
            self._inboxes[rank - 1].send(job)
            if prefix:
                given = torch.stack([torch.stack((k[:prefix], v[:prefix])) for k, v in self._of_stage(kv, rank)])
                sent.append((links.send([given], rank, _PREFIX), rank, given))
        mine = stage_layers(self.config.num_layers, world, 0)
        x, stopped = _run_chunks(self.model, links, 0, world, ids, job, kv[mine.start : mine.stop], on_rows, cancelled)
        for work, rank, _tensor in sent:
            _wait(work, 0, rank, "sending to")
        if stopped is not None:
            raise Cancelled(f"prefill cancelled with {stopped} of its {n} prompt tokens computed or cached")
        if world == 1:
            return self.model.logits(x[-1:])[0]
        for rank in range(1, world):
            layers = stage_layers(self.config.num_layers, world, rank)
            k0 = kv[0][0]
            new = torch.empty((len(layers), 2, n - prefix, *k0.shape[1:]), dtype=k0.dtype, device=k0.device)
            _wait(links.recv([new], rank, _KV), 0, rank, "receiving from")
            for (k_all, v_all), (k_new, v_new), layer in zip(self._of_stage(kv, rank), new, layers, strict=True):
                k_all[prefix:] = k_new
                v_all[prefix:] = v_new
                on_rows(layer, prefix, n)
        logits = torch.empty(self.config.vocab_size, dtype=torch.float32, device=self.model.device)
        _wait(links.recv([logits], world - 1, _LOGITS), 0, world - 1, "receiving from")
        return logits

    def _of_stage(
        self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], rank: int
    ) -> Sequence[tuple[torch.Tensor, torch.Tensor]]:
        layers = stage_layers(self.config.num_layers, self.num_stages, rank)
        return kv[layers.start : layers.stop]

    # ------------------------------------------------------------------ failures and closing

    def _await_built(self) -> None:
        """Return once every stage has built its layers; a stage that fails or exits first is an EngineError."""
        deadline = time.monotonic() + self.start_timeout_s
        pending = dict(zip(self._outboxes, self._processes, strict=True))
        while pending:
            ready = wait_for_sentinels(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise EngineError(f"the pipeline stages did not start within {self.start_timeout_s} s")
            for reader in [r for r in self._outboxes if r in ready]:
                process = pending.pop(reader)
                try:
                    kind, payload, *_ = reader.recv()
                except (EOFError, OSError):
                    process.join(timeout=1.0)
                    raise EngineError(f"{process.name} exited while starting (exit code {process.exitcode})") from None
                if kind != "built":
                    raise EngineError(str(payload))

    def _connect(self, device: str, timeout_s: float) -> Any:
        """Stage 0's end of the links, once every stage has joined them; a stage that fails or exits meanwhile,
        or a rendezvous not done within `start_timeout_s`, is an EngineError at once.

        torch's rendezvous cannot be interrupted and would wait for a dead stage until `timeout_s`, so it runs on
        a helper thread while this one watches the stages. Abandoned, that thread ends by itself once its wait
        runs out (it holds the store until then).
        """
        done_reader, done_writer = multiprocessing.Pipe(duplex=False)
        outcome: list[Any] = []

        def connect() -> None:
            try:
                outcome.append(_process_group(self._store, 0, self.num_stages, device, timeout_s))
            except BaseException as error:
                outcome.append(error)
            finally:
                done_writer.close()  # wakes the watch below (end of file)

        threading.Thread(target=connect, name="cpp-connect", daemon=True).start()
        try:
            deadline = time.monotonic() + self.start_timeout_s
            watched = [done_reader, *self._outboxes, *(p.sentinel for p in self._processes)]
            while not outcome:
                ready = wait_for_sentinels(watched, timeout=max(0.0, deadline - time.monotonic()))
                if done_reader in ready:
                    break
                if ready:  # a stage reported a failure, or exited
                    fallback = "a stage failed while the stages connected"
                    for process in self._processes:
                        if process.sentinel in ready:
                            process.join(timeout=1.0)
                            fallback = f"{process.name} (pid {process.pid}) exited with code {process.exitcode}"
                    raise EngineError(f"a pipeline stage failed to start: {self._blame(fallback)}")
                raise EngineError(
                    f"the pipeline stages did not connect within start_timeout_s={self.start_timeout_s} s"
                )
        finally:
            done_reader.close()
        if isinstance(outcome[0], BaseException):
            raise EngineError(f"the pipeline stages failed to connect: {outcome[0]}") from outcome[0]
        return outcome[0]

    def _collect_reports(self, wait_s: float) -> None:
        """Read every report the stages have sent, waiting up to `wait_s` for those still running to send one."""
        with self._reading:
            deadline = time.monotonic() + wait_s
            open_ = [reader for reader in self._outboxes if not reader.closed]
            while open_:
                ready = wait_for_sentinels(open_, timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    return
                for reader in ready:
                    assert isinstance(reader, Connection)  # only the stages' report pipes are waited on
                    rank = self._outboxes.index(reader) + 1
                    try:
                        kind, text, *rest = reader.recv()
                    except (EOFError, OSError, ValueError):  # the stage is gone: it will send nothing more
                        self._gone.add(rank)
                        open_.remove(reader)
                        continue
                    if kind == "error":
                        peer, timed_out = rest if rest else (None, False)
                        self._reports.setdefault(rank, (str(text), peer, bool(timed_out)))
                        open_.remove(reader)

    def _blame(self, fallback: str, own: _LinkError | None = None) -> str:
        """The group's failure, told by its cause rather than by whoever noticed it first.

        In order: a stage process that a signal ended (its peers' broken links follow from it) or stopped
        (SIGSTOP: whoever waits on it times out, maybe before the stage next to it does); the stage at the end of
        a chain of timeouts (stage 0 timed out on 2, 2 on 1: 1 stopped answering); a stage's own error; a
        stage's broken link; else `fallback`. `own` is stage 0's failed transfer.
        """
        with self._reading:
            self._collect_reports(0.5)  # a stage reports just before it exits: give the others a moment to send theirs
            for rank, process in enumerate(self._processes, start=1):
                # Its sockets may close (its peers' errors) a moment before the process can be reaped: if it is
                # exiting, wait for its exit code.
                if process.exitcode is None and (
                    rank in self._gone or wait_for_sentinels([process.sentinel], timeout=0)
                ):
                    process.join(timeout=1.0)
                if process.exitcode is not None and process.exitcode < 0:
                    return f"{process.name} (pid {process.pid}) exited with code {process.exitcode}"
            reports = dict(self._reports)
            if own is not None:
                reports[0] = (str(own), own.peer, own.timed_out)
            for rank, process in enumerate(self._processes, start=1):
                if process.exitcode is None and _is_stopped(process.pid):
                    noticed = next((text for text, _peer, timed_out in reports.values() if timed_out), fallback)
                    return f"stage {rank} stopped answering ({process.name}, pid {process.pid}, is stopped): {noticed}"
            waiting = [rank for rank in sorted(reports) if reports[rank][2]]
            if waiting:
                last, seen = waiting[0], {waiting[0]}
                stalled = reports[last][1]
                while stalled in reports and reports[stalled][2] and stalled not in seen:  # it waited on another
                    seen.add(stalled)
                    last, stalled = stalled, reports[stalled][1]
                return f"stage {stalled} stopped answering: {reports[last][0]}"
            if reports:  # a stage's own error before a broken link, which is a peer's doing
                return min(reports.values(), key=lambda report: report[1] is not None)[0]
            return fallback

    def _watch_stages(self) -> None:
        """Fail the group as soon as a stage process exits while it is open."""
        by_sentinel = {p.sentinel: p for p in self._processes}
        while not self._closing.is_set():
            ready = wait_for_sentinels(list(by_sentinel), timeout=0.2)
            if ready and not self._closing.is_set():
                process = by_sentinel[ready[0]]
                with self._reading:
                    process.join(timeout=1.0)
                    if self._failure is None:  # else the group ended its stages: that is what the watch sees
                        exited = f"{process.name} (pid {process.pid}) exited with code {process.exitcode}"
                        self._fail(self._blame(exited))
                if self._on_failure is not None:
                    self._on_failure(str(self._failure))  # a transfer's failure, if it came first
                return

    def _fail(self, reason: str) -> None:
        """Record the group's first failure and end every stage (pending transfers fail, the watch hears of it)."""
        with self._failed:
            if self._failure is not None:
                return
            self._failure = reason
        for process in self._processes:
            with contextlib.suppress(Exception):
                process.kill()

    def check_invariants(self) -> None:
        covered = [
            i for rank in range(self.num_stages) for i in stage_layers(self.config.num_layers, self.num_stages, rank)
        ]
        assert covered == list(range(self.config.num_layers)), "the stages do not cover the layers in order"
        assert len(self._processes) == self.num_stages - 1, "a stage process is missing"
        if self._closing.is_set():
            assert not any(p.is_alive() for p in self._processes), "a stage runs after close()"
        elif self._failure is None:
            assert all(p.is_alive() for p in self._processes), "a stage exited but the group has not failed"

    def close(self) -> None:
        """Stop every stage process (asks, waits briefly, then kills); idempotent."""
        self._closing.set()
        if self._failure is None:
            for inbox, process in zip(self._inboxes, self._processes, strict=False):
                if process.is_alive():
                    with contextlib.suppress(OSError):
                        inbox.send(None)
        for process in self._processes:
            if process.pid is None:
                continue
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        if self._watch is not None and self._watch is not threading.current_thread():
            self._watch.join(timeout=5)
        for end in (*self._inboxes, *self._outboxes):
            end.close()
        self._links = None
        self._store = None

    def __enter__(self) -> PipelineGroup:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
