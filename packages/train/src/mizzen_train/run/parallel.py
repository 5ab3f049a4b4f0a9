"""Where a run's ranks train together: the ``[parallel]`` section, the world ``torchrun``
launched, and the one rank that writes.

A run is launched directly (one rank) or by ``torchrun --nproc-per-node N [--nnodes ...]``
(torchrun's own rendezvous: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``).
``[parallel] tensor = T, context = C`` splits the world: data parallel ``D = world / (T * C)``.

:func:`plan_world` reads the environment and the section (pure, no torch), :func:`check_split`
checks the model and the batch against the split, :func:`join_world` joins the process group
(gloo on a CPU, NCCL on ``LOCAL_RANK``'s GPU) and :meth:`RankWorld.model_parallel` creates
megatron's parallel state with T and C.

Rules (one table, :data:`SPLIT_RULES`, read by :func:`check_split`): the world divides by T*C;
attention heads, query groups, the vocabulary and the FFN width divide by T; the sequence length
divides into 2*C chunks (load-balanced context parallel); every step's rows divide by D times the
micro-batch size.

Invariants:
- Everything is checked before the model is built; a wrong value is a
  :class:`~mizzen_train.run.config.ConfigError` naming the field (or the environment variable),
  the rule and the fix -- the same on every rank.
- Rank 0 is the *writer*: it alone holds the run directory's lock, writes ``run.json``,
  ``metrics.jsonl``, the checkpoints' metadata, eval snapshots and exports, prints progress lines
  and runs the evaluations.  The other ranks take part in the collectives only (slot shards are
  written by the writers the slot checkpoint elects).
- A step that may fail on one rank (validation, opening the run) is run writer-first and its
  outcome agreed (:meth:`RankWorld.agreed`): every rank raises, the failing one its own error,
  the others :class:`RankFailed` (quiet: the failing rank has said why).
- Collectives time out after ``parallel.timeout_s``; a rank that dies is torchrun's to handle
  (it stops the other ranks at once and exits non-zero).
- The process group and parallel state created here are destroyed on the way out; a process
  group that already existed (a test's) is used and left as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from mizzen_train.run.config import ConfigError, opt

__all__ = [
    "SPLIT_RULES",
    "ParallelConfig",
    "RankFailed",
    "RankWorld",
    "WorldPlan",
    "check_split",
    "join_world",
    "one_rank",
    "plan_world",
]

T = TypeVar("T")


@dataclass(frozen=True)
class ParallelConfig:
    tensor: int = opt(1, kind="int", low=1, help="tensor-parallel size T (divides the world)")
    context: int = opt(
        1, kind="int", low=1, help="context-parallel size C; data parallel = world / (T * C)"
    )
    timeout_s: float = opt(
        1800.0, kind="float", low=1.0, help="a collective waiting longer than this fails the run"
    )


class RankFailed(RuntimeError):
    """Another rank failed a step this rank passed; that rank reports why."""


@dataclass(frozen=True)
class WorldPlan:
    """The launch's ranks and their split (from the environment and ``[parallel]``)."""

    rank: int
    local_rank: int
    world_size: int
    tensor: int
    context: int
    timeout_s: float
    #: True when torchrun (or another launcher) set the environment.
    launched: bool

    @property
    def data(self) -> int:
        return self.world_size // (self.tensor * self.context)

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def describe(self) -> dict[str, int]:
        return {
            "world": self.world_size,
            "tensor": self.tensor,
            "context": self.context,
            "data": self.data,
        }


def _env_int(environ: Mapping[str, str], name: str, low: int) -> int | None:
    text = environ.get(name)
    if text is None:
        return None
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < low:
        raise ConfigError(
            name, text, f"must be an integer >= {low}",
            "launch with torchrun (it sets RANK, WORLD_SIZE and LOCAL_RANK), or unset it",
        )  # fmt: skip
    return value


def plan_world(
    parallel: ParallelConfig, environ: Mapping[str, str] | None = None, *, source: str = ""
) -> WorldPlan:
    """The world of this launch: ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (one rank when unset)
    split by ``parallel``; ConfigError for a world the split does not divide."""
    environ = os.environ if environ is None else environ
    world = _env_int(environ, "WORLD_SIZE", 1)
    rank = _env_int(environ, "RANK", 0)
    local = _env_int(environ, "LOCAL_RANK", 0)
    launched = world is not None
    world, rank, local = world or 1, rank or 0, local or 0
    if rank >= world:
        raise ConfigError(
            "RANK", rank, f"must be below WORLD_SIZE={world}", "launch with torchrun"
        )  # fmt: skip
    if launched and world > 1 and not environ.get("MASTER_ADDR"):
        raise ConfigError(
            "MASTER_ADDR", "", "is not set but WORLD_SIZE > 1",
            "launch with torchrun --nproc-per-node N (it runs the rendezvous)",
        )  # fmt: skip
    split = parallel.tensor * parallel.context
    if world % split:
        field = "parallel.tensor" if world % parallel.tensor else "parallel.context"
        value = parallel.tensor if field == "parallel.tensor" else parallel.context
        raise ConfigError(
            field, value,
            f"tensor * context = {split} must divide the world size {world} (WORLD_SIZE)",
            f"launch a multiple of {split} ranks, or choose sizes whose product divides {world}",
            source=source,
        )  # fmt: skip
    return WorldPlan(
        rank, local, world, parallel.tensor, parallel.context, parallel.timeout_s, launched
    )


#: ``check_split``'s one table: (field, the divisor from the plan, what it must divide, that
#: quantity from the model ``spec``, the step's ``rows``, ``seq_len`` and micro-batch ``mbs``).
SPLIT_RULES: tuple[tuple[str, Callable[[WorldPlan], int], str, Callable[..., int]], ...] = (
    ("parallel.tensor", lambda p: p.tensor, "the attention heads",
     lambda spec, rows, seq_len, mbs: spec.num_attention_heads),
    ("parallel.tensor", lambda p: p.tensor, "the query groups (GQA key/value heads)",
     lambda spec, rows, seq_len, mbs: spec.query_groups),
    ("parallel.tensor", lambda p: p.tensor, "the vocabulary size",
     lambda spec, rows, seq_len, mbs: spec.vocab_size),
    ("parallel.tensor", lambda p: p.tensor, "the FFN width",
     lambda spec, rows, seq_len, mbs: spec.ffn_size),
    ("parallel.context", lambda p: 2 * p.context if p.context > 1 else 1, "the sequence length (data.seq_len; "
     "context parallel cuts it into 2 * context chunks)",
     lambda spec, rows, seq_len, mbs: seq_len),
    ("tenants[*].rows", lambda p: p.data, "a step's micro-batches (all tenants' rows / "
     "run.micro_batch_size)", lambda spec, rows, seq_len, mbs: rows // mbs),
)  # fmt: skip


def check_split(
    plan: WorldPlan,
    spec: Any,
    *,
    rows: int,
    seq_len: int,
    micro_batch_size: int,
    source: str,
    context_supported: bool,
) -> None:
    """Every rule of :data:`SPLIT_RULES` for the model ``spec`` (a GPTSpec) and a step of
    ``rows`` rows of ``seq_len`` positions; ConfigError naming the field.
    ``context_supported``: the trainer's attention splits sequences over context ranks."""
    if plan.context > 1 and not context_supported:
        raise ConfigError(
            "parallel.context", plan.context,
            "context parallel needs the packed (THD) attention path, which this trainer's "
            "model does not use", "use parallel.context = 1", source=source,
        )  # fmt: skip
    for field, size_of, what, quantity_of in SPLIT_RULES:
        size = size_of(plan)
        quantity = quantity_of(spec, rows=rows, seq_len=seq_len, mbs=micro_batch_size)
        if quantity % size:
            value = {"parallel.tensor": plan.tensor, "parallel.context": plan.context}.get(
                field, rows
            )
            raise ConfigError(
                field, value,
                f"{what} = {quantity} must be divisible by {size} ({plan.describe()})",
                "choose sizes that divide it (or change the model / rows)", source=source,
            )  # fmt: skip


def _backend(device: str) -> str:
    return "gloo" if device == "cpu" else "nccl"


class RankWorld:
    """This process's place in the run's world (see the module docstring)."""

    def __init__(self, plan: WorldPlan, device: str) -> None:
        self.plan = plan
        self.device = device
        self._leading = False

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def size(self) -> int:
        return self.plan.world_size

    @property
    def is_writer(self) -> bool:
        return self.plan.is_writer

    def bind_thread(self) -> None:
        """The calling thread uses this rank's GPU: CUDA's current device is per host thread,
        and a worker thread starts on GPU 0, where NCCL's object collectives and megatron's
        ``current_device()`` allocations would otherwise go (nothing to do on a CPU)."""
        if self.device != "cpu":
            import torch

            torch.cuda.set_device(self.plan.local_rank)

    # -- collectives over the whole world -------------------------------------------------

    def share(self, value: T) -> T:
        """The writer's ``value`` on every rank (one broadcast of a picklable object)."""
        if self.size == 1:
            return value
        import torch

        box = [value if self.is_writer else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.size > 1:
            import torch

            torch.distributed.barrier()

    def agreed(self, step: Callable[[], T]) -> T:
        """Run ``step`` on the writer first, then on the other ranks; if it raised anywhere (a
        cancellation too), raise on every rank: the failing rank its own exception, the others
        :class:`RankFailed`.  An interrupt (``KeyboardInterrupt``, ``SystemExit``) is not agreed:
        every rank gets the signal, and one waiting in a collective for peers that left would
        hang the shutdown."""
        if self.size == 1:
            return step()
        result: Any = None
        own: BaseException | None = None
        failed_first = None
        if self.is_writer:
            try:
                result = step()
            except (Exception, asyncio.CancelledError) as exc:  # a cancellation is agreed too
                own = exc
            failed_first = self.share(own is not None)
        else:
            failed_first = self.share(None)
            if not failed_first:
                try:
                    result = step()
                except (Exception, asyncio.CancelledError) as exc:
                    own = exc
        failures = self._gather(None if own is None else f"{type(own).__name__}: {own}")
        if own is not None:
            raise own
        failing = [(rank, text) for rank, text in enumerate(failures) if text is not None]
        if failing:
            rank, text = failing[0]
            raise RankFailed(f"rank {rank} failed: {text.splitlines()[0]}")
        return result

    def _gather(self, item: Any) -> list[Any]:
        import torch

        gathered: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(gathered, item)
        return gathered

    # -- the writer leads, the others follow --------------------------------------------

    def lead(self, work: Callable[[], T], follower: Callable[..., None]) -> T | None:
        """The writer runs ``work``, during which every :meth:`order` it gives is carried out
        by the other ranks as ``follower(*args)`` (in the same order, so their collectives
        pair with the writer's); the others return None after the writer's end."""
        if self.size == 1:
            return work()
        if self.is_writer:
            self._leading = True
            try:
                return work()
            finally:
                self._leading = False
                self.share(None)  # the end of the orders
        while True:
            order = self.share(None)
            if order is None:
                return None
            follower(*order)

    def order(self, *args: Any) -> None:
        """Writer, inside :meth:`lead`: the other ranks run ``follower(*args)`` now (outside
        it nobody follows: nothing is sent)."""
        if self._leading:
            self.share(args)

    # -- megatron ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def model_parallel(self) -> Iterator[None]:
        """megatron's parallel state with this world's tensor and context sizes (unless one
        already exists: a test's, left as it was)."""
        if self.device == "cpu":  # megatron is imported here first: after the lock's check
            from mizzen_train.megatron_on_cpu import install_megatron_cpu_shim

            install_megatron_cpu_shim()
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            yield
            return
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.plan.tensor,
            context_parallel_size=self.plan.context,
        )
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


def one_rank() -> RankWorld:
    """The world of a process that has joined none (a trainer before :func:`join_world`)."""
    return RankWorld(plan_world(ParallelConfig(), {}), "cpu")


@contextlib.contextmanager
def single_rank(device: str) -> Iterator[RankWorld]:
    """This process as a world of one rank with megatron's parallel state (TP = CP = 1), whatever
    torchrun variables the environment holds: for what drives the slot executor in-process
    without a run's ``[parallel]`` section (the training service, tests)."""
    with join_world(plan_world(ParallelConfig(), {}), device) as world, world.model_parallel():
        yield world


@contextlib.contextmanager
def join_world(plan: WorldPlan, device: str) -> Iterator[RankWorld]:
    """The process group of ``plan`` (torchrun's ``env://`` rendezvous; a private file one for
    a single rank), with ``parallel.timeout_s`` on every collective; destroyed on the way out."""
    import datetime

    import torch

    if device != "cpu":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(plan.local_rank)
    if torch.distributed.is_initialized():  # a test's group: used, left as it was
        here = dataclasses.replace(
            plan, rank=torch.distributed.get_rank(), world_size=torch.distributed.get_world_size()
        )
        yield RankWorld(here, device)
        return
    timeout = datetime.timedelta(seconds=plan.timeout_s)
    with tempfile.TemporaryDirectory(prefix="mizzen-run-rdzv-") as tmp:
        if plan.launched and plan.world_size > 1:
            torch.distributed.init_process_group(_backend(device), timeout=timeout)
        else:
            torch.distributed.init_process_group(
                _backend(device), init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1,
                timeout=timeout,
            )  # fmt: skip
        try:
            yield RankWorld(plan, device)
        finally:
            torch.distributed.destroy_process_group()
