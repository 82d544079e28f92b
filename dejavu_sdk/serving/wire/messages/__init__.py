"""Messages between the pipeline's head and its stage workers, and between two workers: one frozen class per kind
of message, by role: a worker's life (`life`), a microbatch's steps (`steps`), a recovery's (`recovery`). Each
class's docstring says who sends it to whom, and what the receiver does; `codec` packs each into one tensor and
back. Every receiver handles each class it may receive through one table (class -> handler): the head's receiver
(`Pipeline`), a stage worker's loop (`StageWorker.handlers`), a recovery's waits, a starting fleet's.
"""

from .base import EpochMessage, Message, MicrobatchMessage
from .codec import KINDS, pack, unpack
from .life import (
                   AskRejoin,
                   AskStats,
                   Assign,
                   Failed,
                   Fenced,
                   Heartbeat,
                   Join,
                   Links,
                   Ready,
                   Rejoin,
                   Shutdown,
                   Standby,
                   Stats,
                   Warm,
)
from .recovery import (
                   Drop,
                   GroupAt,
                   Pause,
                   Paused,
                   Relink,
                   Relinked,
                   Restore,
                   RewindSlot,
                   Rewound,
                   SendReplica,
                   Sent,
)
from .steps import (
                   Cancel,
                   Columns,
                   End,
                   Enter,
                   Freed,
                   GroupStart,
                   Kv,
                   LinkLost,
                   MicrobatchFailed,
                   NotEntered,
                   OpenSlot,
                   Prefill,
                   Prefilled,
                   RoundDone,
                   RoundReport,
                   SlotRound,
                   Staged,
)

#: What the pipeline's head receives: its receiver has a handler for each.
TO_HEAD: frozenset[type[Message]] = frozenset({
    Join, Rejoin, Warm, Ready, Heartbeat, Failed, Stats, RoundReport, Prefilled, Freed,
    MicrobatchFailed, LinkLost, NotEntered, Paused, Relinked, Sent, Rewound})
#: What a stage worker's loop receives, from the head or another stage: it has a handler for each.
TO_STAGE: frozenset[type[Message]] = frozenset({
    Shutdown, AskRejoin, Fenced, AskStats, Prefill, OpenSlot, Enter, SlotRound, Kv, Cancel, End,
    Pause, Relink, SendReplica, Restore, Drop, RewindSlot})
#: What a worker waiting for a stage receives (`bootstrap`): its stage, or to wait as a spare, or to stop.
TO_WORKER: frozenset[type[Message]] = frozenset({Standby, Assign, Shutdown, Fenced})

__all__ = ["KINDS", "TO_HEAD", "TO_STAGE", "TO_WORKER", "AskRejoin", "AskStats", "Assign", "Cancel", "Columns",
           "Drop", "End", "Enter", "EpochMessage", "Failed", "Fenced", "Freed", "GroupAt",
           "GroupStart", "Heartbeat", "Join", "Kv", "LinkLost", "Links", "Message", "MicrobatchFailed",
           "MicrobatchMessage", "NotEntered", "OpenSlot", "Pause", "Paused", "Prefill", "Prefilled", "Ready", "Rejoin",
           "Relink", "Relinked", "Restore", "RewindSlot", "Rewound", "RoundDone", "RoundReport",
           "SendReplica", "Sent", "Shutdown", "SlotRound", "Staged", "Standby", "Stats", "Warm",
           "pack", "unpack"]
