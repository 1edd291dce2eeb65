"""MessageQueue with readers on "other hosts" (TCP over 127.0.0.1), as several nodes use it.

Readers 0 .. n_local_reader - 1 read the shared memory, the rest subscribe
over TCP: all see every message in order (large ones too); a remote-only
queue has no shared memory at all; a remote reader stops waiting when the
writer closes the queue, and when the writer's process dies.
"""
import multiprocessing
import os
import signal
import time

import msgspec
import pytest

from vllm_anatomy.executor.shm_broadcast import Handle, MessageQueue, MessageQueueCancelled

CHUNK = 256


def _message(i: int) -> list:
    return [i, bytes([i % 251]) * (3 * CHUNK if i % 5 == 2 else i % 40)]


def _attach(writer: MessageQueue, rank: int) -> MessageQueue:
    handle = msgspec.msgpack.decode(msgspec.msgpack.encode(writer.export_handle()), type=Handle)
    return MessageQueue.create_from_handle(handle, rank)


def test_local_and_remote_readers_see_every_message_in_order():
    writer = MessageQueue(3, CHUNK, 4, n_local_reader=1, connect_ip="127.0.0.1")
    readers = [_attach(writer, r) for r in range(3)]
    try:
        assert [r.is_remote_reader for r in readers] == [False, True, True]
        assert writer.export_handle().remote_subscribe_addr.startswith("tcp://127.0.0.1:")
        writer.wait_until_ready(timeout=10)
        for r in readers:
            r.wait_until_ready(timeout=10)
        for i in range(200):          # wraps the 4-chunk ring: the local reader must keep up
            writer.enqueue(_message(i), timeout=10)
            assert [r.dequeue(timeout=10) for r in readers] == [_message(i)] * 3
    finally:
        for r in readers:
            r.close()
        writer.close()


def test_remote_only_queue_needs_no_shared_memory_and_stops_on_close():
    writer = MessageQueue(1, CHUNK, 4, n_local_reader=0, connect_ip="127.0.0.1")
    reader = _attach(writer, 0)
    try:
        assert writer.buffer is None and writer.export_handle().buffer_handle is None
        writer.wait_until_ready(timeout=10)
        reader.wait_until_ready(timeout=10)
        writer.enqueue({"x": 1})
        writer.close()
        assert reader.dequeue(timeout=10) == {"x": 1}        # drained first ...
        with pytest.raises(MessageQueueCancelled, match="closed"):
            reader.dequeue(timeout=10)                       # ... then told the queue is closed
    finally:
        reader.close()
        writer.close()


def test_remote_queue_needs_an_address():
    with pytest.raises(ValueError, match="connect_ip"):
        MessageQueue(2, CHUNK, 4, n_local_reader=1)


def _writer_main(conn) -> None:
    writer = MessageQueue(1, CHUNK, 4, n_local_reader=0, connect_ip="127.0.0.1")
    conn.send_bytes(msgspec.msgpack.encode(writer.export_handle()))
    writer.wait_until_ready(timeout=30)
    writer.enqueue("hello")
    time.sleep(60)                  # killed by the test long before


def test_remote_reader_notices_the_writer_process_dying():
    ctx = multiprocessing.get_context("spawn")
    recv_end, send_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_writer_main, args=(send_end,))
    proc.start()
    try:
        assert recv_end.poll(60)
        reader = MessageQueue.create_from_handle(msgspec.msgpack.decode(recv_end.recv_bytes(), type=Handle), 0)
        reader.wait_until_ready(timeout=30)
        assert reader.dequeue(timeout=30) == "hello"
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(MessageQueueCancelled, match="connection dropped"):
            reader.dequeue(timeout=30)
        assert time.monotonic() - t0 < 10
        reader.close()
    finally:
        proc.kill()
        proc.join()
