"""A one-writer, many-reader broadcast queue in shared memory.

Mirrors vllm/distributed/device_communicators/shm_broadcast.py (ShmRingBuffer,
MessageQueue, Handle). MultiprocExecutor uses one to broadcast (method, args)
to every worker (`rpc_broadcast_mq`) and one per worker for the reply.

ShmRingBuffer: one POSIX shared-memory segment, no locks:

    [ chunk 0 | chunk 1 | ... | chunk max_chunks-1 ]   max_chunks x max_chunk_bytes
    [ w r0 r1 .. rN-1 ] x max_chunks                   metadata: written flag + one read flag per reader
    [ closed ]                                         one byte: the writer has closed the queue

Chunk states (written, reader flags): 0??? writable (never written, or being
written); 1000 just written; 1?1? partially read; 1111 read by all: writable again.
Each reader owns its own flag, so readers never write the same byte and need no
lock between them; the single writer owns the written flag.

A chunk holds [overflow: 1 byte, 3 pad, length: u32] + a msgpack payload. A
message larger than a chunk "spills": the chunk only carries overflow=1 and the
bytes go over a ZMQ XPUB/SUB ipc socket, as in vLLM.

Readers on other hosts (several nodes, vLLM's n_local_reader < n_reader):
readers 0 .. n_local_reader - 1 read the shared memory; the others subscribe
to a second XPUB socket over TCP (`remote_subscribe_addr`), and the writer
sends every message there too. A remote reader stops waiting when the writer
closes the queue (a close frame) or its connection drops (the writer's
process is gone: a ZMQ socket monitor reports the disconnect).

One file, as vLLM's, though over 400 lines: ShmRingBuffer, Handle and
MessageQueue keep vLLM's names in vLLM's file name, and the queue is the ring's only user.

Simplified: msgspec msgpack instead of pickle with out-of-band buffers (never
pickle here); waiting readers spin then sleep with back-off instead of blocking on
vLLM's ZMQ notify socket (SpinCondition).
"""
from __future__ import annotations

import contextlib
import logging
import os
import struct
import sys
import tempfile
import threading
import time
import uuid
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Iterator

import msgspec
import zmq

logger = logging.getLogger(__name__)

VLLM_RINGBUFFER_WARNING_INTERVAL = 60.0   # seconds between "still waiting" log lines (vLLM env var)
SPIN_S = 1e-3          # busy-spin (sched_yield) this long before sleeping
MAX_SLEEP_S = 1e-3     # back-off sleeps grow up to this
SHM_PREFIX = "vllm_anatomy_mq_"
SHM_DIR = "/dev/shm"      # where Linux lists POSIX shared-memory segments (a tmpfs)
_HEADER = struct.Struct("<?3xI")          # overflow flag, pad, payload length
_READY = b"READY"
# Frames on the remote (TCP) socket: a message, or "the writer closed the queue".
_REMOTE_MESSAGE, _REMOTE_CLOSED = b"M", b"C"
_default_decoder = msgspec.msgpack.Decoder()

_memory_fence_lock = threading.Lock()


def memory_fence() -> None:
    """A full memory barrier between the data and the flags.

    NOTE: CPython gives no ordering guarantee across processes by itself.
    Acquiring and releasing a lock is a full barrier on every platform (it
    is built on atomic read-modify-write instructions), so flag stores cannot
    be observed before the data stores that precede them (same trick as vLLM)."""
    with _memory_fence_lock:
        pass


def shm_name_prefix(ipc_dir: str | None) -> str:
    """The name prefix of every segment whose queue sockets live in `ipc_dir`.

    NOTE: a segment's name carries its run's socket directory (made by the
    process that owns the run, e.g. the API server), so that owner can find
    and unlink the segments of a child it outlived, even one SIGKILLed before
    it could unlink its own (see unlink_shm_segments)."""
    return SHM_PREFIX + (os.path.basename(os.path.normpath(ipc_dir)) + "_" if ipc_dir else "")


def unlink_shm_segments(ipc_dir: str) -> list[str]:
    """Unlink every segment named after `ipc_dir` (shm_name_prefix); returns their names.

    For the owner of a run's directory, whose children may have died without
    cleaning up.
    Safe while a child still runs: unlinking only removes the name (mappings
    stay valid; the memory is freed when the last process unmaps it).
    NOTE: exactly one shm_unlink of a name succeeds, and only that caller
    tells the resource tracker, which the whole process tree shares
    (spawn passes it on), so the tracker neither warns about the segment
    at exit nor hears of it twice. Linux only: elsewhere it finds nothing.
    """
    prefix = shm_name_prefix(ipc_dir)
    if not os.path.isdir(SHM_DIR):
        return []
    removed = []
    for name in sorted(os.listdir(SHM_DIR)):
        if not name.startswith(prefix):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))     # glibc's shm_unlink is exactly this
        except FileNotFoundError:
            continue                                   # its creator unlinked it meanwhile
        resource_tracker.unregister("/" + name, "shared_memory")
        removed.append(name)
    return removed


class MessageQueueCancelled(RuntimeError):
    """A wait ended because its cancel event was set or the writer closed the queue."""


class _Waiter:
    """One wait: busy-spin briefly, then sleep with back-off; raise on timeout / cancel."""

    def __init__(self, what: str, timeout: float | None, cancel: threading.Event | None) -> None:
        self.what, self.timeout, self.cancel = what, timeout, cancel
        self.start = self.last_warning = time.monotonic()
        self.sleep_s = 0.0

    def check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise MessageQueueCancelled(f"{self.what}: cancelled")
        now = time.monotonic()
        if self.timeout is not None and now - self.start >= self.timeout:
            raise TimeoutError(f"{self.what}: nothing happened within {self.timeout} s")
        if now - self.last_warning > VLLM_RINGBUFFER_WARNING_INTERVAL:
            self.last_warning = now
            logger.info("%s: still waiting after %.0f s", self.what, now - self.start)

    def wait(self) -> None:
        self.check()
        if time.monotonic() - self.start < SPIN_S:
            os.sched_yield()
        else:
            self.sleep_s = min(max(self.sleep_s * 2, 1e-5), MAX_SLEEP_S)
            time.sleep(self.sleep_s)


@contextlib.contextmanager
def _untracked_attach() -> Iterator[None]:
    """NOTE: before Python 3.13, *attaching* to a segment also registers it with
    the resource tracker, which would unlink it when this (reader) process
    exits, under the writer's feet. Only the creator should be tracked."""
    original = resource_tracker.register
    resource_tracker.register = lambda name, rtype: None
    try:
        yield
    finally:
        resource_tracker.register = original


class ShmRingBufferHandle(msgspec.Struct, frozen=True):
    n_reader: int
    max_chunk_bytes: int
    max_chunks: int
    name: str


class ShmRingBuffer:

    def __init__(self, n_reader: int, max_chunk_bytes: int, max_chunks: int, name: str | None = None,
                 name_prefix: str = SHM_PREFIX) -> None:
        if max_chunk_bytes <= _HEADER.size or max_chunks < 1 or n_reader < 1:
            raise ValueError("need n_reader >= 1, max_chunks >= 1 and room for the chunk header")
        self.n_reader, self.max_chunk_bytes, self.max_chunks = n_reader, max_chunk_bytes, max_chunks
        self.metadata_size = 1 + n_reader
        self.metadata_offset = max_chunk_bytes * max_chunks
        self.closed_offset = self.metadata_offset + self.metadata_size * max_chunks
        self.total_bytes_of_buffer = self.closed_offset + 1
        self.is_creator = name is None
        if self.is_creator:
            # NOTE: a new POSIX segment is zero-filled: every chunk starts in
            # state 0??? (never written), which is writable.
            self.shared_memory = SharedMemory(name=name_prefix + uuid.uuid4().hex[:16], create=True,
                                              size=self.total_bytes_of_buffer)
        elif sys.version_info >= (3, 13):
            self.shared_memory = SharedMemory(name=name, track=False)
        else:
            with _untracked_attach():
                self.shared_memory = SharedMemory(name=name)
        self.name = self.shared_memory.name
        buf = self.shared_memory.buf
        assert buf is not None          # (None only once the segment is closed)
        self.buf: memoryview = buf

    def handle(self) -> ShmRingBufferHandle:
        return ShmRingBufferHandle(self.n_reader, self.max_chunk_bytes, self.max_chunks, self.name)

    # -- flags (one byte each; single-byte stores cannot tear) ---------------------
    def _meta(self, chunk: int) -> int:
        return self.metadata_offset + chunk * self.metadata_size

    def get_written(self, chunk: int) -> int:
        return self.buf[self._meta(chunk)]

    def set_written(self, chunk: int, value: int) -> None:
        self.buf[self._meta(chunk)] = value

    def get_read(self, chunk: int, reader: int) -> int:
        return self.buf[self._meta(chunk) + 1 + reader]

    def set_read(self, chunk: int, reader: int) -> None:
        self.buf[self._meta(chunk) + 1 + reader] = 1

    def num_read(self, chunk: int) -> int:
        start = self._meta(chunk) + 1
        return sum(self.buf[start:start + self.n_reader].tobytes())

    def clear_read_flags(self, chunk: int) -> None:
        start = self._meta(chunk) + 1
        self.buf[start:start + self.n_reader] = bytes(self.n_reader)

    @property
    def writer_closed(self) -> bool:
        return self.buf[self.closed_offset] == 1

    def mark_writer_closed(self) -> None:
        self.buf[self.closed_offset] = 1

    @contextlib.contextmanager
    def get_data(self, chunk: int) -> Iterator[memoryview]:
        # NOTE: the slice is released on exit: a live view would keep the
        # mapping exported and make close() fail with BufferError.
        start = chunk * self.max_chunk_bytes
        with self.buf[start:start + self.max_chunk_bytes] as view:
            yield view

    def close(self) -> None:
        del self.buf            # our reference to the mapping: SharedMemory.close() releases it
        self.shared_memory.close()

    def unlink(self) -> None:
        """Remove the name from /dev/shm (mappings stay valid until closed). Idempotent."""
        with contextlib.suppress(FileNotFoundError):
            self.shared_memory.unlink()


class Handle(msgspec.Struct, frozen=True):
    """Everything a reader in another process needs to attach (msgspec, never pickle).

    Readers 0 .. n_local_reader - 1 attach to the shared memory (same host);
    the rest, on other hosts, subscribe to remote_subscribe_addr (TCP)."""
    buffer_handle: ShmRingBufferHandle | None
    local_subscribe_addr: str | None
    n_reader: int = 1
    n_local_reader: int = 1
    remote_subscribe_addr: str | None = None


class MessageQueue:
    # NOTE: a queue without local readers has no ring and no spill socket, one
    # without remote readers no TCP socket; only a remote reader has a monitor.
    buffer: ShmRingBuffer | None
    local_socket: zmq.Socket | None
    local_subscribe_addr: str | None
    remote_socket: zmq.Socket | None
    remote_monitor: zmq.Socket | None
    remote_subscribe_addr: str | None

    def __init__(self, n_reader: int, max_chunk_bytes: int = 1 << 20, max_chunks: int = 10,
                 ipc_dir: str | None = None, n_local_reader: int | None = None,
                 connect_ip: str | None = None) -> None:
        """Create the queue; the creating process is its single writer.

        `ipc_dir`: where the spill socket goes (default: the temp dir); it also
        names the segment (shm_name_prefix), so whoever owns the directory can
        unlink the segment if this process dies without doing so.
        `n_local_reader` (default: all) read the shared memory; the other
        readers connect over TCP to `connect_ip`, this host's address as they see it."""
        self.n_reader = n_reader
        self.n_local_reader = n_reader if n_local_reader is None else n_local_reader
        self._is_writer, self.local_reader_rank = True, -1
        self.current_idx = 0
        self._closed = False
        self.encoder = msgspec.msgpack.Encoder()
        self.context = zmq.Context()
        self.remote_socket = self.remote_monitor = None
        self.remote_subscribe_addr = None
        if self.n_local_reader < n_reader:
            self._bind_remote(connect_ip)
        self.buffer = self.local_socket = self.local_subscribe_addr = None
        if self.n_local_reader > 0:
            self._bind_local(max_chunk_bytes, max_chunks, ipc_dir)

    def _bind_remote(self, connect_ip: str | None) -> None:
        if connect_ip is None:
            raise ValueError("a queue with remote readers needs connect_ip (this host's address)")
        self.remote_socket = self.context.socket(zmq.XPUB)
        self.remote_socket.setsockopt(zmq.XPUB_VERBOSE, True)
        self.remote_socket.setsockopt(zmq.LINGER, 1000)
        host = f"[{connect_ip}]" if ":" in connect_ip else connect_ip
        if ":" in connect_ip:
            self.remote_socket.setsockopt(zmq.IPV6, 1)
        # NOTE: no authentication on this socket, as in vLLM: the nodes of a
        # run are expected to share a private network.
        port = self.remote_socket.bind_to_random_port(f"tcp://{host}")
        self.remote_subscribe_addr = f"tcp://{host}:{port}"

    def _bind_local(self, max_chunk_bytes: int, max_chunks: int, ipc_dir: str | None) -> None:
        prefix = shm_name_prefix(ipc_dir)
        self.buffer = ShmRingBuffer(self.n_local_reader, max_chunk_bytes, max_chunks, name_prefix=prefix)
        self.local_socket = self.context.socket(zmq.XPUB)
        # NOTE: pass every subscription up to us (not only the first per
        # topic): wait_until_ready counts them, one per reader.
        self.local_socket.setsockopt(zmq.XPUB_VERBOSE, True)
        # NOTE: on close, give spilled frames up to 1 s to reach live readers.
        self.local_socket.setsockopt(zmq.LINGER, 1000)
        # NOTE: the socket file is named by the segment's random part only: a
        # Unix socket path must stay under 108 bytes.
        unique = self.buffer.name[len(prefix):]
        path = os.path.join(ipc_dir or tempfile.gettempdir(), f"{SHM_PREFIX}{unique}.sock")
        self.local_subscribe_addr = f"ipc://{path}"
        self.local_socket.bind(self.local_subscribe_addr)
        os.chmod(path, 0o600)     # NOTE: like the segment itself: only this user may connect

    def export_handle(self) -> Handle:
        return Handle(self.buffer.handle() if self.buffer is not None else None, self.local_subscribe_addr,
                      self.n_reader, self.n_local_reader, self.remote_subscribe_addr)

    @classmethod
    def create_from_handle(cls, handle: Handle, rank: int) -> "MessageQueue":
        """Attach as reader `rank` (0 <= rank < n_reader), e.g. in another process
        (ranks from n_local_reader on: on another host, over TCP)."""
        if not 0 <= rank < handle.n_reader:
            raise ValueError(f"reader rank {rank} out of range for {handle.n_reader} readers")
        self = cls.__new__(cls)
        self.n_reader, self.n_local_reader = handle.n_reader, handle.n_local_reader
        self._is_writer, self.local_reader_rank = False, rank
        self.current_idx = 0
        self._closed = False
        self.encoder = msgspec.msgpack.Encoder()
        self.context = zmq.Context()
        self.buffer = self.local_socket = self.remote_socket = self.remote_monitor = None
        self.local_subscribe_addr, self.remote_subscribe_addr = handle.local_subscribe_addr, None
        if rank >= handle.n_local_reader:
            assert handle.remote_subscribe_addr is not None, "a queue with remote readers has a TCP address"
            self._connect_remote(handle.remote_subscribe_addr)
            return self
        bh = handle.buffer_handle
        assert bh is not None, "a queue with local readers has a ring"
        self.buffer = ShmRingBuffer(bh.n_reader, bh.max_chunk_bytes, bh.max_chunks, name=bh.name)
        self.local_socket = self.context.socket(zmq.SUB)
        self.local_socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.local_socket.setsockopt(zmq.LINGER, 0)
        assert self.local_subscribe_addr is not None, "a queue with local readers has a spill socket"
        self.local_socket.connect(self.local_subscribe_addr)
        return self

    def _connect_remote(self, address: str) -> None:
        self.remote_subscribe_addr = address
        self.remote_socket = self.context.socket(zmq.SUB)
        self.remote_socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.remote_socket.setsockopt(zmq.LINGER, 0)
        if address.startswith("tcp://["):
            self.remote_socket.setsockopt(zmq.IPV6, 1)
        # NOTE: tells us when the TCP connection to the writer drops: its
        # process is gone (a close would have sent _REMOTE_CLOSED first).
        self.remote_monitor = self.remote_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.remote_socket.connect(address)

    @property
    def is_remote_reader(self) -> bool:
        return not self._is_writer and self.remote_socket is not None

    def wait_until_ready(self, timeout: float | None = None, cancel: threading.Event | None = None) -> None:
        """Handshake over the spill socket; both sides call it once before use.

        NOTE: PUB/SUB drops frames sent before a subscription reaches the
        publisher ("slow joiner"). The writer waits until it has seen one
        subscription per reader, then sends READY, which every reader waits for:
        after that, no spilled frame can be lost."""
        waiter = _Waiter("MessageQueue.wait_until_ready", timeout, cancel)
        if self._is_writer:
            for socket, n in ((self.local_socket, self.n_local_reader),
                              (self.remote_socket, self.n_reader - self.n_local_reader)):
                subscribed = 0
                while subscribed < n:
                    subscribed += self._recv(waiter, socket)[:1] == b"\x01"     # b"\x00": an unsubscribe
                if socket is not None:
                    socket.send(_READY)
        elif self._recv(waiter, self.remote_socket or self.local_socket) != _READY:
            raise RuntimeError("MessageQueue: unexpected first frame on the spill socket")

    def _recv(self, waiter: _Waiter, socket: zmq.Socket | None = None) -> bytes:
        socket = socket or self.local_socket
        assert socket is not None, "a reader or writer of the ring has its spill socket"
        while not socket.poll(timeout=10):
            waiter.check()
            if self.remote_monitor is not None and self.remote_monitor.poll(timeout=0):
                raise MessageQueueCancelled("MessageQueue: the writer's connection dropped (its process is gone)")
        return socket.recv()

    # -- writer ---------------------------------------------------------------------
    @contextlib.contextmanager
    def acquire_write(self, timeout: float | None = None,
                      cancel: threading.Event | None = None) -> Iterator[memoryview]:
        assert self._is_writer, "only the writer can enqueue"
        buffer, idx = self.buffer, self.current_idx
        assert buffer is not None, "enqueue writes the ring only when there are local readers"
        waiter = _Waiter("MessageQueue.acquire_write", timeout, cancel)
        while buffer.get_written(idx) and buffer.num_read(idx) != buffer.n_reader:
            waiter.wait()      # some reader has not read this chunk yet: the ring is full
        # NOTE: mark unwritten first, so the chunk is never "written and unread"
        # while its bytes change.
        buffer.set_written(idx, 0)
        with buffer.get_data(idx) as chunk:
            yield chunk
        # NOTE: data first, then reset the reader flags, then set written LAST,
        # each behind a fence: a reader that sees written=1 with its flag clear
        # is guaranteed to see the whole new payload, never a stale or
        # half-written one (a cleared flag already implies complete data).
        memory_fence()
        buffer.clear_read_flags(idx)
        memory_fence()
        buffer.set_written(idx, 1)
        memory_fence()
        self.current_idx = (idx + 1) % buffer.max_chunks

    def enqueue(self, obj, timeout: float | None = None, cancel: threading.Event | None = None) -> None:
        data = self.encoder.encode(obj)
        if self.remote_socket is not None:
            # NOTE: remote readers get every message over TCP, whatever its size;
            # sent first, so a host that reads it does not wait on the local ring.
            self.remote_socket.send_multipart((_REMOTE_MESSAGE, data), copy=False)
        if self.buffer is not None:
            self._enqueue_local(data, timeout, cancel)

    def _enqueue_local(self, data: bytes, timeout: float | None, cancel: threading.Event | None) -> None:
        assert self.buffer is not None and self.local_socket is not None
        overflow = _HEADER.size + len(data) > self.buffer.max_chunk_bytes
        with self.acquire_write(timeout, cancel) as chunk:
            if overflow:
                # NOTE: the frame is sent *after* a free chunk was acquired, so at
                # most max_chunks frames are ever in flight: far below ZMQ's
                # high-water mark, where PUB would silently drop.
                _HEADER.pack_into(chunk, 0, True, 0)
                self.local_socket.send(data, copy=False)
            else:
                _HEADER.pack_into(chunk, 0, False, len(data))
                chunk[_HEADER.size:_HEADER.size + len(data)] = data

    # -- reader ---------------------------------------------------------------------
    @contextlib.contextmanager
    def acquire_read(self, timeout: float | None = None,
                     cancel: threading.Event | None = None) -> Iterator[tuple[memoryview, _Waiter]]:
        assert not self._is_writer, "only readers can dequeue"
        buffer, idx, rank = self.buffer, self.current_idx, self.local_reader_rank
        assert buffer is not None, "a local reader has the ring"
        waiter = _Waiter("MessageQueue.acquire_read", timeout, cancel)
        while not (buffer.get_written(idx) and not buffer.get_read(idx, rank)):
            # NOTE: "closed" is checked only when nothing is ready, so a reader
            # still drains every message written before close().
            if buffer.writer_closed:
                raise MessageQueueCancelled("MessageQueue.acquire_read: the writer closed the queue")
            waiter.wait()
        memory_fence()         # NOTE: read the data only after seeing the flag
        with buffer.get_data(idx) as chunk:
            yield chunk, waiter
        memory_fence()         # NOTE: finish reading before handing the chunk back
        buffer.set_read(idx, rank)
        self.current_idx = (idx + 1) % buffer.max_chunks

    def dequeue(self, timeout: float | None = None, cancel: threading.Event | None = None,
                decoder: msgspec.msgpack.Decoder | None = None):
        """Next message for this reader; decoded with `decoder` (default: builtins)."""
        if self.is_remote_reader:
            return (decoder or _default_decoder).decode(self._dequeue_remote(timeout, cancel))
        with self.acquire_read(timeout, cancel) as (chunk, waiter):
            overflow, length = _HEADER.unpack_from(chunk, 0)
            # NOTE: copy out and release the chunk before decoding: a message
            # that fails to decode must not wedge the ring.
            data = self._recv(waiter) if overflow else chunk[_HEADER.size:_HEADER.size + length].tobytes()
        return (decoder or _default_decoder).decode(data)

    def _dequeue_remote(self, timeout: float | None, cancel: threading.Event | None) -> bytes:
        socket, monitor = self.remote_socket, self.remote_monitor
        assert socket is not None and monitor is not None, "a remote reader has its socket and monitor"
        waiter = _Waiter("MessageQueue.dequeue (remote)", timeout, cancel)
        while not socket.poll(timeout=10):
            waiter.check()
            if monitor.poll(timeout=0):
                raise MessageQueueCancelled("MessageQueue: the writer's connection dropped (its process is gone)")
        kind, *data = socket.recv_multipart()
        if kind == _REMOTE_CLOSED:
            raise MessageQueueCancelled("MessageQueue.dequeue: the writer closed the queue")
        return data[0]

    # -- teardown -------------------------------------------------------------------
    def close(self) -> None:
        """Writer: mark closed (readers stop waiting), unlink. Reader: detach. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._is_writer and self.buffer is not None:
            self.buffer.mark_writer_closed()
        if self._is_writer and self.remote_socket is not None:
            self.remote_socket.send(_REMOTE_CLOSED)      # NOTE: lingers up to 1 s to reach them
        if self.remote_socket is not None and self.remote_monitor is not None:
            self.remote_socket.disable_monitor()
        for socket in (self.local_socket, self.remote_monitor, self.remote_socket):
            if socket is not None:
                socket.close()
        self.context.term()
        if self._is_writer and self.local_subscribe_addr is not None:
            # NOTE: libzmq leaves the ipc socket file behind; connected readers keep working.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.local_subscribe_addr[len("ipc://"):])
        if self.buffer is not None:
            self.buffer.close()
            if self.buffer.is_creator:
                self.buffer.unlink()
