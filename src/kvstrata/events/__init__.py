"""KV cache events: vLLM-compatible wire format and a sequenced ZMQ event plane.

``schema`` defines and decodes the events; ``publisher`` sends them with sequence numbers and a
replay buffer; ``subscriber`` receives them in order, filling gaps by replay.
"""

from kvstrata.events.publisher import ZmqEventPublisher
from kvstrata.events.schema import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    EventDecodeError,
    KVEvent,
    KVEventBatch,
    UnknownEventError,
    decode_batch,
    encode_batch,
    make_batch,
)
from kvstrata.events.subscriber import (
    EventPlaneStats,
    PollResult,
    ReceivedBatch,
    ZmqEventSubscriber,
)

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "EventDecodeError",
    "EventPlaneStats",
    "KVEvent",
    "KVEventBatch",
    "PollResult",
    "ReceivedBatch",
    "UnknownEventError",
    "ZmqEventPublisher",
    "ZmqEventSubscriber",
    "decode_batch",
    "encode_batch",
    "make_batch",
]
