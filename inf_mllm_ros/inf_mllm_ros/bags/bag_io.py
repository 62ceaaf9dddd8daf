"""Read rosbag2 bags (mcap or sqlite3) without ROS, for replay and offline runs.

Message types are resolved per bag: definitions embedded in the bag win (Iron and later embed
them), and types without one come from the ``rosbags`` type store of the distribution that wrote
the bag (Humble, Jazzy, Kilted; the latest LTS when the bag does not say). Every problem is raised
as :class:`BagError`, whose message names the bag and what is wrong with it.

    >>> for item in iter_messages("sample_bags/warehouse_shift"):
    ...     if item.msgtype.startswith("sensor_msgs/"):
    ...         rgb = msg_to_rgb(item.msg)   # inf_mllm_ros.image_conversion
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

__all__ = [
    "BagError",
    "BagMessage",
    "BagTopic",
    "Bag",
    "iter_messages",
    "open_bag",
]

STORAGE_SUFFIXES = {".mcap": "mcap", ".db3": "sqlite3"}


class BagError(Exception):
    """A bag cannot be read as asked; the message names the path and the problem."""


@dataclass(frozen=True)
class BagTopic:
    """One topic of a bag."""

    name: str
    msgtype: str
    count: int


@dataclass
class BagMessage:
    """One message of a bag, in time order; ``msg`` is deserialized on first access."""

    topic: str
    msgtype: str
    timestamp_ns: int
    rawdata: bytes
    _deserialize: Callable[[bytes, str], Any] = field(repr=False, compare=False)

    @cached_property
    def msg(self) -> Any:
        return self._deserialize(self.rawdata, self.msgtype)


def _default_store_name(ros_distro: str | None):
    """The rosbags store for the distribution that wrote the bag, or the latest LTS."""
    from rosbags.typesys import Stores

    stores = {
        "humble": Stores.ROS2_HUMBLE,
        "iron": Stores.ROS2_IRON,
        "jazzy": Stores.ROS2_JAZZY,
        "kilted": Stores.ROS2_KILTED,
    }
    return stores.get((ros_distro or "").strip().lower(), Stores.LATEST)


def _embedded_types(path: Path, connections) -> dict:
    """Type definitions the bag carries itself (msg or idl text per connection)."""
    from rosbags.interfaces import MessageDefinitionFormat
    from rosbags.typesys import get_types_from_idl, get_types_from_msg

    types: dict = {}
    for conn in connections:
        fmt, text = conn.msgdef.format, conn.msgdef.data
        if fmt == MessageDefinitionFormat.NONE or not text.strip():
            continue
        try:
            if fmt == MessageDefinitionFormat.MSG:
                types.update(get_types_from_msg(text, conn.msgtype))
            else:
                separator = "=" * 80 + "\n"
                # rosbag2 joins a type and its dependencies as "=====\nIDL: name\n<idl>" parts.
                bundled = text.startswith(separator + "IDL: ")
                for part in text.split(separator)[1:] if bundled else [text]:
                    idl = part.split("\n", 1)[1] if part.startswith("IDL: ") else part
                    types.update(get_types_from_idl(idl))
        except Exception as err:  # the parsers raise several kinds on bad text
            raise BagError(
                f"{path}: the embedded definition of {conn.msgtype!r} on topic {conn.topic!r} "
                f"is malformed: {err}"
            ) from None
    return types


class Bag:
    """An open rosbag2 bag. Use :func:`open_bag`; close it, or use it as a context manager."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._reader = _open_reader(self.path)
        try:
            self._resolve_types()
        except BaseException:
            self.close()
            raise

    # --- description ---------------------------------------------------------------------
    @property
    def topics(self) -> dict[str, BagTopic]:
        """Topic name -> :class:`BagTopic`, for every topic the bag declares."""
        out: dict[str, BagTopic] = {}
        for conn in self._reader.connections:
            seen = out.get(conn.topic)
            count = conn.msgcount + (seen.count if seen else 0)
            out[conn.topic] = BagTopic(conn.topic, conn.msgtype, count)
        return out

    @property
    def message_count(self) -> int:
        return int(self._reader.message_count)

    @property
    def start_ns(self) -> int:
        return int(self._reader.start_time)

    @property
    def end_ns(self) -> int:
        """One nanosecond past the last message, as rosbag2 counts it."""
        return int(self._reader.end_time)

    @property
    def ros_distro(self) -> str | None:
        return self._reader.ros_distro

    @property
    def unknown_types(self) -> dict[str, list[str]]:
        """Message type -> topics, for types with no definition in the bag or the type store."""
        return {k: list(v) for k, v in self._unknown.items()}

    # --- reading -------------------------------------------------------------------------
    def messages(self, topics: Iterable[str] | None = None) -> Iterator[BagMessage]:
        """Messages in time order (ties: by topic name, then as stored).

        ``topics`` limits the output; each named topic must exist and hold messages, and its
        type must be known, or :class:`BagError` is raised before anything is yielded.
        """
        # Validate now, not at the first next(), so a bad request fails where it is made.
        return self._iterate(self._select(topics))

    def _iterate(self, connections: list) -> Iterator[BagMessage]:
        if self._reader is None:
            raise BagError(f"{self.path}: the bag is closed")
        stream = self._guarded(self._reader.messages(connections=connections))
        for _, group in itertools.groupby(stream, key=lambda item: item[1]):
            batch = list(group)
            if len(batch) > 1:
                batch.sort(key=lambda item: item[0].topic)  # stable: keeps stored order per topic
            for conn, timestamp, data in batch:
                yield BagMessage(conn.topic, conn.msgtype, int(timestamp), bytes(data),
                                 self._deserialize)

    def close(self) -> None:
        reader, self._reader = getattr(self, "_reader", None), None
        if reader is not None and reader.is_open:
            reader.close()

    def __enter__(self) -> Bag:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Bag({str(self.path)!r}, {self.message_count} messages, topics={list(self.topics)})"

    # --- internals -----------------------------------------------------------------------
    def _resolve_types(self) -> None:
        from rosbags.typesys import Stores, get_typestore

        connections = self._reader.connections
        embedded = _embedded_types(self.path, connections)
        default = get_typestore(_default_store_name(self.ros_distro))
        store = get_typestore(Stores.EMPTY)
        # Embedded definitions first; the default store fills in every other name, so types
        # without an embedded definition still resolve, nested types included.
        fill = {name: d for name, d in default.fielddefs.items() if name not in embedded}
        try:
            store.register(embedded)
            store.register(fill)
        except Exception as err:
            raise BagError(f"{self.path}: message definitions do not fit together: {err}") from None
        self._store = store
        self._unknown: dict[str, list[str]] = {}
        for conn in connections:
            if conn.msgtype not in store.fielddefs:
                self._unknown.setdefault(conn.msgtype, []).append(conn.topic)

    def _select(self, topics: Iterable[str] | None) -> list:
        connections = list(self._reader.connections)
        if topics is None:
            return connections
        wanted = list(dict.fromkeys([topics] if isinstance(topics, str) else topics))
        known = self.topics
        missing = [t for t in wanted if t not in known]
        if missing:
            raise BagError(
                f"{self.path}: no topic {', '.join(map(repr, missing))} in the bag; "
                f"it has {', '.join(known) or 'no topics'}"
            )
        empty = [t for t in wanted if known[t].count == 0]
        if empty and len(empty) == len(wanted):
            raise BagError(f"{self.path}: no messages on {', '.join(map(repr, empty))}")
        for topic in wanted:
            if known[topic].msgtype in self._unknown:
                raise BagError(self._unknown_message(known[topic].msgtype, topic))
        return [c for c in connections if c.topic in wanted]

    def _unknown_message(self, msgtype: str, topic: str) -> str:
        store = _default_store_name(self.ros_distro).value
        return (
            f"{self.path}: topic {topic!r} has message type {msgtype!r}, which has no definition "
            f"in the bag nor in the rosbags type store {store!r}"
        )

    def _deserialize(self, rawdata: bytes, msgtype: str) -> Any:
        if msgtype in self._unknown:
            raise BagError(self._unknown_message(msgtype, self._unknown[msgtype][0]))
        try:
            return self._store.deserialize_cdr(rawdata, msgtype)
        except Exception as err:  # rosbags raises several kinds on bad CDR
            raise BagError(
                f"{self.path}: cannot deserialize a {len(rawdata)}-byte {msgtype} message: "
                f"{type(err).__name__}: {err}"
            ) from None

    def _guarded(self, raw: Iterator) -> Iterator:
        """Turn storage errors met while reading into BagError."""
        try:
            yield from raw
        except BagError:
            raise
        except Exception as err:
            raise BagError(
                f"{self.path}: storage is damaged, reading stopped: {_describe(err)}"
            ) from None


def _open_reader(path: Path):
    """Open a rosbags Reader on a bag folder or a single .mcap/.db3 file."""
    from rosbags.rosbag2 import Reader

    if not path.exists():
        raise BagError(f"{path}: no such bag (the path does not exist)")
    if path.is_dir():
        if not (path / "metadata.yaml").is_file():
            raise BagError(f"{path}: not a rosbag2 bag: the folder has no metadata.yaml")
    elif path.suffix not in STORAGE_SUFFIXES:
        raise BagError(
            f"{path}: not a rosbag2 bag: expected a folder with metadata.yaml, "
            f"or a {' or '.join(STORAGE_SUFFIXES)} file"
        )
    try:
        reader = Reader(path)
        reader.open()
    except PermissionError as err:
        raise BagError(f"{path}: cannot read the bag: {err}") from None
    except Exception as err:  # rosbags, sqlite3, yaml and struct all raise their own kinds
        raise BagError(f"{path}: malformed bag: {_describe(err)}") from None
    return reader


def _describe(err: Exception) -> str:
    """The error's text; its class name too unless it is rosbags' own (already worded) error."""
    from rosbags.rosbag2 import ReaderError

    return str(err) if isinstance(err, ReaderError) else f"{type(err).__name__}: {err}"


def open_bag(path: str | Path) -> Bag:
    """Open a rosbag2 bag folder (mcap or sqlite3 storage) or a single .mcap/.db3 file."""
    return Bag(path)


def iter_messages(path: str | Path, topics: Iterable[str] | None = None) -> Iterator[BagMessage]:
    """Yield the bag's messages in time order, optionally only those on ``topics``."""
    bag = open_bag(path)
    try:
        stream = bag.messages(topics)
    except BaseException:
        bag.close()
        raise
    return _closing(bag, stream)


def _closing(bag: Bag, stream: Iterator[BagMessage]) -> Iterator[BagMessage]:
    with bag:
        yield from stream
