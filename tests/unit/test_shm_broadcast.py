"""MessageQueue / ShmRingBuffer: one writer, N reader processes, in order, no leaks.

Reader processes are started with multiprocessing spawn and attach by the
msgspec-encoded Handle, as WorkerProc does. They check the order themselves and
report a summary over a pipe (msgspec bytes).
"""
import hashlib
import multiprocessing
import os
import threading
import time

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_anatomy.executor.shm_broadcast import Handle, MessageQueue, MessageQueueCancelled

CHUNK = 256        # small chunks: many messages spill, the ring wraps often
NUM_CHUNKS = 4


def _message(i: int) -> list:
    # Every 7th message is larger than a chunk and must take the spill path.
    payload = bytes([i % 251]) * (3 * CHUNK if i % 7 == 3 else i % 50)
    return [i, payload]


def _reader_main(handle_bytes: bytes, rank: int, n: int, result_pipe) -> None:
    mq = MessageQueue.create_from_handle(msgspec.msgpack.decode(handle_bytes, type=Handle), rank)
    try:
        mq.wait_until_ready(timeout=30)
        digest, errors = hashlib.sha256(), []
        for expected in range(n):
            i, payload = mq.dequeue(timeout=30)
            if [i, payload] != _message(expected):
                errors.append(f"rank {rank}: got #{i} (len {len(payload)}) where #{expected} was due")
            digest.update(payload)
        result_pipe.send_bytes(msgspec.msgpack.encode([errors, digest.hexdigest()]))
    finally:
        mq.close()


def _shm_exists(name: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", name))


def _pair(n_reader: int, max_chunk_bytes: int = CHUNK, max_chunks: int = NUM_CHUNKS):
    writer = MessageQueue(n_reader, max_chunk_bytes, max_chunks)
    readers = [MessageQueue.create_from_handle(writer.export_handle(), r) for r in range(n_reader)]
    writer.wait_until_ready(timeout=10)
    for r in readers:
        r.wait_until_ready(timeout=10)
    return writer, readers


@pytest.mark.parametrize("n_reader", [1, 3])
def test_reader_processes_see_every_message_in_order(n_reader):
    n = 3000      # wraps the 4-chunk ring 750 times; ~430 messages spill
    ctx = multiprocessing.get_context("spawn")
    writer = MessageQueue(n_reader, CHUNK, NUM_CHUNKS)
    handle = writer.export_handle()
    pipes, procs = [], []
    try:
        for rank in range(n_reader):
            recv_end, send_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_reader_main, args=(msgspec.msgpack.encode(handle), rank, n, send_end))
            proc.start()
            send_end.close()
            pipes.append(recv_end)
            procs.append(proc)
        writer.wait_until_ready(timeout=60)
        expected = hashlib.sha256()
        for i in range(n):
            msg = _message(i)
            writer.enqueue(msg, timeout=30)
            expected.update(msg[1])
        for rank, pipe in enumerate(pipes):
            assert pipe.poll(60), f"reader {rank} sent no result"
            errors, digest = msgspec.msgpack.decode(pipe.recv_bytes())
            assert errors == []
            assert digest == expected.hexdigest()
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        writer.close()
    assert all(p.exitcode == 0 for p in procs)
    assert not _shm_exists(handle.buffer_handle.name)
    assert not os.path.exists(handle.local_subscribe_addr[len("ipc://"):])


def test_handle_round_trips_through_msgspec():
    writer = MessageQueue(2, CHUNK, NUM_CHUNKS)
    try:
        handle = writer.export_handle()
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(handle), type=Handle)
        assert decoded == handle
        assert decoded.buffer_handle.name.startswith("vllm_anatomy_mq_")
        with pytest.raises(ValueError):
            MessageQueue.create_from_handle(decoded, 2)       # only ranks 0 and 1 exist
    finally:
        writer.close()


def test_oversized_messages_spill_and_keep_their_place():
    writer, (reader,) = _pair(1)
    try:
        big = {"blob": b"\x01" * (20 * CHUNK), "n": 1}
        writer.enqueue("small")
        writer.enqueue(big)
        writer.enqueue("after")
        assert [reader.dequeue(timeout=5) for _ in range(3)] == ["small", big, "after"]
    finally:
        writer.close()
        reader.close()


def test_full_ring_and_empty_queue_time_out():
    writer, (r0, r1) = _pair(2)
    try:
        for i in range(NUM_CHUNKS):
            writer.enqueue(i, timeout=1)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="acquire_write"):
            writer.enqueue("one too many", timeout=0.2)
        assert 0.2 <= time.monotonic() - t0 < 2
        assert [r0.dequeue(timeout=1) for _ in range(NUM_CHUNKS)] == list(range(NUM_CHUNKS))
        # r1 has read nothing: every chunk is still owed to it.
        with pytest.raises(TimeoutError):
            writer.enqueue("still full", timeout=0.05)
        with pytest.raises(TimeoutError, match="acquire_read"):
            r0.dequeue(timeout=0.1)
        assert r1.dequeue(timeout=1) == 0
        writer.enqueue("fits now", timeout=0.5)
    finally:
        writer.close()
        r0.close()
        r1.close()


def test_cancel_event_stops_a_waiting_reader():
    writer, (reader,) = _pair(1)
    cancel = threading.Event()
    try:
        threading.Timer(0.2, cancel.set).start()
        t0 = time.monotonic()
        with pytest.raises(MessageQueueCancelled):
            reader.dequeue(cancel=cancel)
        assert time.monotonic() - t0 < 5
    finally:
        writer.close()
        reader.close()


def test_reader_drains_then_stops_when_the_writer_closes():
    writer, (reader,) = _pair(1)
    name = writer.export_handle().buffer_handle.name
    try:
        writer.enqueue("a")
        writer.enqueue("b")
        writer.close()
        # Unlinked at once; the reader's mapping stays valid until it closes.
        assert not _shm_exists(name)
        assert [reader.dequeue(timeout=1), reader.dequeue(timeout=1)] == ["a", "b"]
        with pytest.raises(MessageQueueCancelled, match="writer closed"):
            reader.dequeue(timeout=5)
    finally:
        reader.close()
        writer.close()      # idempotent


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(min_value=-1, max_value=1), max_size=60))
def test_ring_matches_a_model_of_bounded_fifo_per_reader(ops):
    """-1: enqueue; 0/1: reader 0/1 dequeues. Zero timeouts: each op succeeds iff the model says so."""
    writer, readers = _pair(2, max_chunk_bytes=64, max_chunks=3)
    sent, consumed = 0, [0, 0]
    try:
        for op in ops:
            if op == -1:
                can = sent - min(consumed) < 3
                try:
                    writer.enqueue(sent, timeout=0)
                    assert can, "enqueue succeeded on a full ring"
                    sent += 1
                except TimeoutError:
                    assert not can, "enqueue failed with a free chunk"
            else:
                try:
                    got = readers[op].dequeue(timeout=0)
                    assert got == consumed[op], "out of order"
                    consumed[op] += 1
                except TimeoutError:
                    assert consumed[op] == sent, "dequeue failed with a message waiting"
    finally:
        writer.close()
        for r in readers:
            r.close()
