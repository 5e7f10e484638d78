"""Reads an offline W&B run file (`run-*.wandb`) back: a LevelDB-style log of protobuf `Record`s.

Format (wandb's own datastore): a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of records, each
with a 7-byte header (CRC32C, length, type: 1 full, 2 first, 3 middle, 4 last); a block tail under 7 bytes is padding.
"""

import json
import struct

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path):
    # imported here, not at the top: collecting the test files (the GPU tier on a machine without wandb) needs no wandb
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a W&B run file"
    offset, pending = 7, b""
    while offset + 7 <= len(data):
        room = BLOCK - offset % BLOCK
        if room < 7:  # padding at the end of a block
            offset += room
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        payload = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind == FULL:
            pending = payload
        elif kind == FIRST:
            pending = payload
            continue
        elif kind == MIDDLE:
            pending += payload
            continue
        else:
            pending += payload
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        yield record
        pending = b""


def _items(items):
    return {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in items}


def read_run(path):
    """(history rows, config, summary) of an offline run file."""
    history, config, summary = [], {}, {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(_items(record.history.item))
        elif kind == "config":
            config.update(_items(record.config.update))
        elif kind == "summary":
            summary.update(_items(record.summary.update))
        elif kind == "run":
            config.setdefault("_run_name", record.run.display_name)
    return history, config, summary
