"""What the notebook and the live ranks send each other (nbkit.live).

Calls travel through ipyparallel (its apply requests carry these dataclasses, pickled); a rank's
output, its dashboard events and its end-of-call marks travel over the relay connection that each
rank opens to the notebook (nbkit.messages.rank), because they must arrive while a call still runs. Every
message on the relay is the rank channel's Envelope, which names the rank, so the bodies here carry no rank of
their own; the bodies every channel shares (Started, Report, and Result, Raised or Returned in a call's Outcome)
are nbkit.messages.rank's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nbkit.messages.rank import Raised, Result, Returned

__all__ = ["CallDone", "Display", "EngineInfo", "Lost", "Outcome", "Output", "RankPlan", "Training"]


@dataclass
class EngineInfo:
    """Who an engine is, asked before ranks are assigned.

    Attributes:
        pid: the engine's process id.
        host: its node name: NBKIT_HOST where set (stand-ins for hosts in tests), else the host name.
        address: the address other nodes reach it at: NBKIT_HOST_ADDRESS where set, else the host
            name resolved.
        gpus: CUDA devices the engine sees (0 without CUDA); counted without creating a context.
    """

    pid: int
    host: str
    address: str
    gpus: int


@dataclass
class RankPlan:
    """What one engine becomes: sent once, by LiveRanks, before anything else runs there.

    Attributes:
        rank, local_rank, world_size, local_world_size, node_rank, nnodes: the usual torchrun meanings.
        master_addr, master_port: the rendezvous (rank 0's node).
        relay: (host, port) of the notebook's relay listener; authkey: its key.
        use_cuda: put rank on cuda:local_rank and use nccl (else gloo on the CPU).
        owned: nbkit started the engine (nbkit.start, not connect): it ends on SIGTERM without
            running destructors.
        env: the rank's nbkit environment (nbkit.launching.rank_contract.rank_environment, with nbkit.start(env=...)).
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    nnodes: int
    master_addr: str
    master_port: int
    relay: tuple[str, int]
    authkey: bytes
    use_cuda: bool
    owned: bool = False
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Output:
    """Text a rank wrote to sys.stdout or sys.stderr during a call."""

    stream: str  # "stdout" | "stderr"
    text: str


@dataclass
class Display:
    """What a rank passed to IPython's display() during a call (a display_data message's fields)."""

    data: dict
    metadata: dict
    transient: dict
    update: bool


@dataclass
class CallDone:
    """A rank finished call `call` (sent after its last output, so nothing of the call is behind it)."""

    call: int
    failed: bool


@dataclass
class Interrupted:
    """Python on a rank saw the notebook's interrupt (SIGINT) during call `call`: the rank runs Python code,
    not a collective, so a call that goes on after it caught the KeyboardInterrupt.
    """

    call: int


@dataclass
class Training:
    """A rank entered Trainer.train() (running=True) or left it (nbkit.rank_side.live_stopping).

    Attributes:
        running: whether train() runs now.
        step: Trainer's global step at that moment.
        stopped: train() ended because an interrupt asked it to stop, at `step`, the same on every rank.
    """

    running: bool
    step: int
    stopped: bool = False


@dataclass(frozen=True)
class Lost:
    """Not sent by a rank: the notebook's relay puts it in an Envelope of its own when a rank's
    connection closes, which means the rank died.

    Attributes:
        rank: the rank the connection said it was (its first message, channel.Started); None for one
            that closed before it said (a rank that died while connecting).
    """

    rank: int | None

    @property
    def what(self) -> str:
        """What happened, in words for a message: "rank 1's connection to the notebook closed"."""
        if self.rank is None:
            return "a connection to the notebook closed before it said which rank it was"
        return f"rank {self.rank}'s connection to the notebook closed"


@dataclass(frozen=True)
class Outcome:
    """How a call ended on one rank (what ipyparallel's apply returns; the rank is the one it ran on).

    Attributes:
        answer: the rank channel's body for it: Result (the value, pickled, tensors on the CPU, where the
            notebook asked for it), Raised (the error), or Returned (it returned, and its value was not asked for).
        names_loaded: the notebook names sent with the call (run_code) are defined on the rank (False when
            rebuilding one failed, or the call had none); the notebook then counts them as sent there.
    """

    answer: Result | Raised | Returned
    names_loaded: bool = False
