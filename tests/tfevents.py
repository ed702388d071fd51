"""Reading TensorBoard event files back in tests.

The TFRecord framing (length, masked CRC32C of the length, payload, masked CRC32C of the payload) is
checked here independently of the writer, as TensorBoard checks it; the payloads are decoded with
the `Event` protocol buffers tensorboardX ships (the same schema as TensorFlow's).
"""

import struct
from pathlib import Path

from tensorboardX.proto import event_pb2


def _table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), bit by bit from its polynomial: no code shared with any writer."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC: rotate right by 15 and add a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(path: str | Path) -> list:
    """Every `Event` in the file, after checking each record's framing and both CRCs."""
    data = Path(path).read_bytes()
    events, i = [], 0
    while i < len(data):
        header = data[i : i + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[i + 8 : i + 12])[0] == masked_crc(header), (
            f"bad length CRC at byte {i}"
        )
        record = data[i + 12 : i + 12 + length]
        assert len(record) == length, f"truncated record at byte {i}"
        assert struct.unpack("<I",
                             data[i + 12 + length : i + 16 + length])[0] == masked_crc(record), (
      f"bad payload CRC at byte {i}"
        )
        events.append(event_pb2.Event.FromString(record))
        i += 16 + length
    return events


def scalars(events: list) -> dict:
    """``{(tag, step): value}`` of the scalar summaries in ``events``."""
    return {
        (value.tag, event.step): value.simple_value
        for event in events
        if event.HasField("summary")
        for value in event.summary.value
    }
