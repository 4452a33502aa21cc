"""``bench listen``: thousands of concurrent listen streams on one tritask process.

The server (``python -m stress.bench.servers listen``) holds ``tasks`` task-required ``step``
calls, each waiting for input. The benchmark opens ``streams`` Streamable HTTP listen streams
(``subscriptions/listen`` with ``taskIds``: stream ``i`` watches task ``i % tasks``) on raw
sockets, each read by one trio task of this process, and then answers every task at a steady
``updates_per_second``: each answer commits twice (input accepted: ``working``; the tool
finishes: ``completed``), and each commit is pushed to the ``streams / tasks`` streams watching
that task.

Reported, in the JSON:

* ``rssPerStreamKiB``: the server's resident memory (``/proc/PID/status``) with every stream
  open and acknowledged, minus before any was opened, divided by the number of streams: the
  HTTP connection, the request's task and context, the hub subscription and the listen state;
* ``p50Ms``/``p99Ms``/``maxMs`` from commit to notification: the receive time in this process
  minus the commit instant the notification carries (``lastUpdatedAt``, the memory store's
  wall clock in µs; both processes read the same clock). It includes this client's own delay
  in reading 10,000 sockets, so it is an upper bound of the server's part;
* ``serverCpuSeconds`` during the drive (``/proc/PID/stat``);
* every stream must receive exactly its task's two pushes (``missing``/``unexpected`` count
  the others: a stream that keeps up may not lose a state).

The baseline is the same measurement with ``baseline_streams`` streams (default 100) in the
same process, before the big round, so the ratio shows what 10,000 open streams cost each
notification. Targets: < 20 KiB per stream and p99 < 50 ms with the streams open.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from stress.bench.benchmarks import process_cpu_seconds
from tritask.tasks import parse_instant

__all__ = ["ListenParams", "bench_listen"]

RSS_TARGET_KIB = 20.0
P99_TARGET_MS = 50.0
_VERSION = "2026-07-28"
_TASKS_CAPS: dict[str, Any] = {
    "extensions": {"io.modelcontextprotocol/tasks": {}},
    "elicitation": {},
}
_CONNECT_CONCURRENCY = 200


@attrs.frozen
class ListenParams:
    streams: int = 10_000
    tasks: int = 1_000
    updates_per_second: float = 50.0
    baseline_streams: int = 100


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _body(request_id: int | str, method: str, params: dict[str, Any]) -> bytes:
    meta = {
        "io.modelcontextprotocol/protocolVersion": _VERSION,
        "io.modelcontextprotocol/clientCapabilities": _TASKS_CAPS,
    }
    return json.dumps(
        {"jsonrpc": "2.0", "id": request_id, "method": method, "params": {**params, "_meta": meta}}
    ).encode()


def _request(port: int, method: str, body: bytes, name: str | None = None) -> bytes:
    head = (
        f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: application/json, text/event-stream\r\nMcp-Protocol-Version: {_VERSION}\r\n"
        f"Mcp-Method: {method}\r\n"
        + (f"Mcp-Name: {name}\r\n" if name is not None else "")
        + f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _Call:
    """One keep-alive connection for the control calls (create, answer)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stream: trio.SocketStream | None = None
        self.buffer = b""
        self.ids = 0

    async def call(self, method: str, params: dict[str, Any], name: str | None = None) -> Any:
        if self.stream is None:
            self.stream = await trio.open_tcp_stream("127.0.0.1", self.port)
        self.ids += 1
        await self.stream.send_all(
            _request(self.port, method, _body(self.ids, method, params), name)
        )
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += await self._receive()
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            rest += await self._receive()
        self.buffer = rest[length:]
        answer = json.loads(rest[:length])
        if "error" in answer:
            raise RuntimeError(f"{method} failed: {answer['error']}")
        return answer["result"]

    async def _receive(self) -> bytes:
        assert self.stream is not None
        data = await self.stream.receive_some(65536)
        if not data:
            raise RuntimeError("the server closed the control connection")
        return data

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()


@attrs.define(eq=False)
class _Stream:
    task_id: str
    opened: trio.Event = attrs.field(factory=trio.Event)
    statuses: list[str] = attrs.field(factory=list)
    delays_us: list[int] = attrs.field(factory=list)
    failed: str | None = None


async def _listen(port: int, index: int, stream: _Stream, measuring: list[bool]) -> None:
    """Open one listen stream and record every ``notifications/tasks`` until it completes."""
    body = _body(
        f"listen-{index}", "subscriptions/listen", {"notifications": {"taskIds": [stream.task_id]}}
    )
    try:
        sock = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError as exc:
        stream.failed = f"connect: {exc}"
        stream.opened.set()
        return
    async with sock:
        await sock.send_all(_request(port, "subscriptions/listen", body))
        raw = b""  # what the socket gave, not yet decoded
        head_done = False
        chunked = False
        text = b""  # the decoded SSE body, not yet split into events
        while True:
            data = await sock.receive_some(65536)
            if not data:
                stream.failed = stream.failed or "closed"
                stream.opened.set()
                return
            received_us = time.time_ns() // 1000
            raw += data
            if not head_done:
                if b"\r\n\r\n" not in raw:
                    continue
                head, _, raw = raw.partition(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    stream.failed = head.split(b"\r\n", 1)[0].decode(errors="replace")
                    stream.opened.set()
                    return
                chunked = b"transfer-encoding: chunked" in head.lower()
                head_done = True
            if chunked:
                while True:
                    size_end = raw.find(b"\r\n")
                    if size_end < 0:
                        break
                    size = int(raw[:size_end].split(b";")[0], 16)
                    if len(raw) < size_end + 2 + size + 2:
                        break
                    text += raw[size_end + 2 : size_end + 2 + size]
                    raw = raw[size_end + 2 + size + 2 :]
            else:
                text, raw = text + raw, b""
            while (end := text.find(b"\n\n")) >= 0:
                event, text = text[:end], text[end + 2 :]
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    message = json.loads(line[5:])
                    if message.get("method") != "notifications/tasks":
                        continue
                    params = message["params"]
                    if not stream.opened.is_set():
                        stream.opened.set()  # the acknowledgement and the current state
                        continue
                    stream.statuses.append(params["status"])
                    if measuring[0]:
                        stream.delays_us.append(
                            received_us - parse_instant(params["lastUpdatedAt"])
                        )
                    if params["status"] == "completed":
                        return


def _percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


async def _round(port: int, pid: int, streams: int, tasks: int, rate: float) -> dict[str, Any]:
    control = _Call(port)
    ids: list[str] = []
    for _ in range(tasks):
        result = await control.call(
            "tools/call", {"name": "step", "arguments": {"rounds": 1}}, "step"
        )
        ids.append(result["taskId"])
    # Every task waits for its input before any stream opens (its current state is steady).
    for task_id in ids:
        with trio.fail_after(60):
            while True:
                got = await control.call("tasks/get", {"taskId": task_id}, task_id)
                if got["status"] == "input_required":
                    break
                await trio.sleep(0.005)
    gc.collect()
    await trio.sleep(0.5)
    rss_before = _rss_kib(pid)
    watched = [_Stream(ids[index % tasks]) for index in range(streams)]
    measuring = [False]
    limiter = trio.Semaphore(_CONNECT_CONCURRENCY)
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:

        async def open_one(index: int) -> None:
            async with limiter:
                nursery.start_soon(_listen, port, index, watched[index], measuring)
                await watched[index].opened.wait()

        async with trio.open_nursery() as opening:
            for index in range(streams):
                opening.start_soon(open_one, index)
        open_seconds = time.perf_counter() - started
        await trio.sleep(1.0)
        rss_open = _rss_kib(pid)
        # The measuring client's own collector must not add its pauses to the delays: what
        # it holds for 10,000 streams is frozen out of its collections while it measures.
        gc.collect()
        gc.freeze()
        # A fresh control connection: the first one sat idle while the streams opened, and
        # the server closes a keep-alive connection idle for 75 s.
        await control.aclose()
        control = _Call(port)
        measuring[0] = True
        cpu_before = process_cpu_seconds(pid)
        answered_at = time.perf_counter()
        for number, task_id in enumerate(ids):
            due = answered_at + number / rate
            await trio.sleep(max(0.0, due - time.perf_counter()))
            await control.call(
                "tasks/update",
                {"taskId": task_id, "inputResponses": {"r0": {"action": "accept"}}},
                task_id,
            )
        with trio.move_on_after(60) as waited:
            while True:
                if all(s.failed is not None or "completed" in s.statuses for s in watched):
                    break
                await trio.sleep(0.05)
        drive_seconds = time.perf_counter() - answered_at
        cpu_after = process_cpu_seconds(pid)
        gc.unfreeze()
        nursery.cancel_scope.cancel()
    rss_after = _rss_kib(pid)
    await control.aclose()
    delays = [d / 1000 for s in watched for d in s.delays_us]
    failed = [s.failed for s in watched if s.failed is not None]
    missing = sum(1 for s in watched if s.failed is None and s.statuses != ["working", "completed"])
    return {
        "streams": streams,
        "tasks": tasks,
        "streamsFailed": len(failed),
        "failures": sorted(set(failed))[:5],
        "streamsWithWrongStatuses": missing,
        "timedOut": waited.cancelled_caught,
        "notifications": len(delays),
        "commits": 2 * tasks,
        "driveSeconds": round(drive_seconds, 2),
        "serverCpuSeconds": None
        if cpu_before is None or cpu_after is None
        else round(cpu_after - cpu_before, 2),
        "updatesPerSecond": rate,
        "openSeconds": round(open_seconds, 2),
        "rssBeforeKiB": rss_before,
        "rssOpenKiB": rss_open,
        "rssAfterKiB": rss_after,
        "rssPerStreamKiB": round((rss_open - rss_before) / streams, 2),
        "p50Ms": round(_percentile(delays, 0.50), 3),
        "p99Ms": round(_percentile(delays, 0.99), 3),
        "maxMs": round(max(delays), 3) if delays else None,
    }


async def bench_listen(params: ListenParams) -> dict[str, Any]:
    from stress.bench.benchmarks import ServerProcess, _result

    if params.streams < params.tasks or params.baseline_streams < 1:
        raise ValueError("streams must be >= tasks, baseline_streams >= 1")
    async with ServerProcess.start("listen", "--max-jobs", str(2 * (params.tasks + 1))) as server:
        pid = server.process.pid
        baseline_tasks = min(params.tasks, params.baseline_streams)
        baseline = await _round(
            server.port, pid, params.baseline_streams, baseline_tasks, params.updates_per_second
        )
        tritask = await _round(
            server.port, pid, params.streams, params.tasks, params.updates_per_second
        )
    errors = sum(
        side["streamsFailed"] + side["streamsWithWrongStatuses"] + int(side["timedOut"])
        for side in (baseline, tritask)
    )
    target_met = (
        errors == 0
        and tritask["rssPerStreamKiB"] < RSS_TARGET_KIB
        and tritask["p99Ms"] < P99_TARGET_MS
    )
    ratio = {
        "p99": round(tritask["p99Ms"] / baseline["p99Ms"], 2) if baseline["p99Ms"] else None,
        "p50": round(tritask["p50Ms"] / baseline["p50Ms"], 2) if baseline["p50Ms"] else None,
    }
    return _result(
        "listen",
        {**attrs.asdict(params), "pid": os.getpid()},
        tritask,
        baseline,
        ratio,
        target_met,
        errors=errors,
        targets={"rssPerStreamKiB": RSS_TARGET_KIB, "p99Ms": P99_TARGET_MS},
    )
